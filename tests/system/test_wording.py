"""A count and its noun agree in what the commands print: ``1 step``, ``2 steps`` (one helper,
``dcr_core.text.plural``, wherever a count meets a noun)."""

from __future__ import annotations

import pytest
import torch

from dcr_core.text import plural
from flows import run_publish
from flows.receive.pipeline import run_receive
from tests.support.cli import dcr
from tests.support.helpers import chunk_at, chunk_named, stored_chunks


def test_plural_takes_the_form_the_count_asks_for():
    assert [plural(n, "step") for n in (0, 1, 2)] == ["0 steps", "1 step", "2 steps"]
    assert [plural(n, "entry", "entries") for n in (1, 3)] == ["1 entry", "3 entries"]
    assert plural(1, "step", count=False) == "step" and plural(4, "step", count=False) == "steps"


@pytest.fixture
def one_step(tmp_path) -> str:
    """A bucket of one step (one chunk), with one receiver at it."""
    root = str(tmp_path / "bucket")
    run_publish(root, {"w": torch.ones(64)}, 0)
    run_receive(root, "rollout-0", str(tmp_path / "r.safetensors"))
    return root


def test_what_the_commands_print_about_one_step_reads_in_the_singular(one_step, tmp_path):
    verified = dcr("verify", one_step, check=0).stdout
    assert verified.startswith("verify ok: 1 step, 1 chunk, "), verified
    assert dcr("status", one_step, "--receiver", "rollout-0", check=0).stdout.startswith("receiver rollout-0: 1 refit recorded")
    reported = dcr("report", one_step, "--out", tmp_path / "report", check=0).stdout
    assert "(1 step, 1 receiver; figures: " in reported, reported
    run_publish(one_step, {"w": torch.zeros(64)}, 1, keyframe=True)
    run_receive(one_step, "rollout-0", str(tmp_path / "r.safetensors"))  # step 0 held by no one: gc takes it
    collected = dcr("gc", one_step, "--keep", 1, check=0).stdout
    assert "deleted 1 step and 0 stale attempts" in collected and "kept 1 step " in collected, collected


@pytest.mark.faults(component="bad input or damaged bucket", outcome="dcr verify names the damaged chunk; its summary counts 1 error")
def test_one_error_is_counted_in_the_singular(one_step):
    chunks = stored_chunks(one_step, 0)
    assert len(chunks) == 1, chunks
    path, offset, _ = chunk_at(one_step, 0, *chunks[0])
    with open(path, "r+b") as f:
        f.seek(offset)
        head = f.read(4)
        f.seek(offset)
        f.write(bytes(b ^ 0xFF for b in head))
    out = dcr("verify", one_step)
    assert chunk_named(one_step, 0, *chunks[0]) in out.stdout + out.stderr, out
    assert out.stdout.startswith("verify FAILED: 1 step, 0 chunks, ") and out.stdout.rstrip().endswith(", 1 error"), out
