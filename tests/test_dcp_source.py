"""``dcr publish ROOT DCP_DIR``: torch.distributed.checkpoint directories published from their chunks."""

from __future__ import annotations

import json
import os
import pickle
import warnings

import pytest
import torch

from dcr_core.errors import InvalidCheckpointError
from flows.cli import main
from flows.dcp_source import dcp_sources, is_dcp_dir, read_dcp_metadata
from flows.pipeline import run_receive
from storage.checkpoint import SafetensorsCheckpoint
from tests.helpers import assert_bits_equal, nasty_tensor, next_step

warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")


def _save(state: dict, path) -> None:
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(path))


def _ckpt(seed: int) -> dict[str, torch.Tensor]:
    return {
        "w.bf16": nasty_tensor("BF16", (13, 11), seed, "a"),
        "w.f32": nasty_tensor("F32", (37,), seed, "b"),
        "w.f16": nasty_tensor("F16", (3, 5, 7), seed, "c"),
        "w.i64": nasty_tensor("I64", (4,), seed, "d"),
        "w.scalar": nasty_tensor("F32", (), seed, "e"),
        "w.empty": nasty_tensor("BF16", (0, 3), seed, "f"),
    }


def _held(path) -> dict[str, torch.Tensor]:
    ck = SafetensorsCheckpoint(path)
    return {n: ck.tensor(n) for n in ck.infos}


def test_cli_publishes_dcp_directories_bit_exact(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("DCR_CACHE_DIR", str(tmp_path / "cache"))
    root, state = str(tmp_path / "bucket"), str(tmp_path / "r.safetensors")
    a = _ckpt(1)
    b = next_step(a, 2, fraction=0.2, unchanged=0.0)
    _save({"model": a, "step": 5}, tmp_path / "dcp-a")  # nested dict -> "model.w.bf16"; "step" is bytes
    _save({"model": b, "step": 6}, tmp_path / "dcp-b")
    assert is_dcp_dir(tmp_path / "dcp-a")
    for step, (d, ck) in enumerate((("dcp-a", a), ("dcp-b", b))):
        rc = main(["publish", root, str(tmp_path / d), "--step", str(step), "--dcp-prefix", "model.",
                   "--chunk-bytes", "32", "--orchestrator", "none", "--json"])
        assert rc == 0
        out = json.loads(capsys.readouterr().out)
        assert out["kind"] == ("keyframe" if step == 0 else "delta")
        run_receive(root, "r", state)
        assert_bits_equal(_held(state), ck)


def test_metadata_is_never_unpickled(tmp_path):
    """A .metadata that refers to anything outside the DCP metadata types is refused, unexecuted."""
    _save({"x": torch.ones(2)}, tmp_path / "d")

    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned > " + str(tmp_path / "pwned"),))

    (tmp_path / "d" / ".metadata").write_bytes(pickle.dumps(Evil()))
    with pytest.raises(InvalidCheckpointError, match="not an allowed metadata type"):
        read_dcp_metadata(str(tmp_path / "d"))
    assert not (tmp_path / "pwned").exists()


def test_chunk_that_disagrees_with_metadata_is_refused(tmp_path):
    _save({"x": torch.ones(4, dtype=torch.float32)}, tmp_path / "d")
    src = dcp_sources(tmp_path / "d")
    files = [f for f in os.listdir(tmp_path / "d") if f.endswith(".distcp")]
    p = tmp_path / "d" / files[0]
    data = p.read_bytes()
    p.write_bytes(data[: len(data) // 2])
    with pytest.raises(InvalidCheckpointError, match="truncated|cannot load"):
        src[0].snapshot()
