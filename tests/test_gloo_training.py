"""A real multi-process run: 2 gloo ranks train with tensor parallelism and FSDP2, publish every
step from their shards, and a receiver equals the independently gathered canonical checkpoint."""

from __future__ import annotations

import json
import socket

import pytest
import torch.multiprocessing as mp

from tests import gloo_trainer


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_tp_and_fsdp2_ranks_publish_every_step_bit_exact(tmp_path):
    out = tmp_path / "report.json"
    steps = 5
    mp.start_processes(
        gloo_trainer.worker,
        args=(2, _free_port(), str(tmp_path / "bucket"), str(tmp_path / "cache"), str(out), steps),
        nprocs=2, start_method="spawn", join=True,
    )
    report = json.loads(out.read_text())
    assert [r["step"] for r in report] == list(range(steps))
    assert [r["kind"] for r in report] == ["keyframe"] + ["delta"] * (steps - 1)
    for r in report:
        assert r["names"] == sorted([gloo_trainer.UP, gloo_trainer.DOWN, gloo_trainer.HEAD, gloo_trainer.NORM])
        assert r["differ"] == [], r
    assert all(r["changed"] > 0 for r in report[1:])  # training really changed stored bits
