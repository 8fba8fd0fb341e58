"""A real multi-process run: 2 gloo ranks train with tensor parallelism and FSDP2, publish every
step from their shards, and a receiver equals the independently gathered canonical checkpoint."""

from __future__ import annotations

import json

import torch.multiprocessing as mp

from flows import run_receive
from flows.cli import main
from storage.catalog import Catalog
from storage.root import Root
from tests.support import gloo_trainer
from tests.support.helpers import assert_bits_equal, read_state
from tests.support.servers import free_port


def test_tp_and_fsdp2_ranks_publish_every_step_bit_exact(tmp_path, monkeypatch):
    monkeypatch.setenv("DCR_CACHE_DIR", str(tmp_path / "cli-cache"))
    out = tmp_path / "report.json"
    steps = 5
    mp.start_processes(
        gloo_trainer.worker,
        args=(2, free_port(), str(tmp_path / "bucket"), str(tmp_path / "cache"), str(out), steps, (1, 3)),
        nprocs=2, start_method="spawn", join=True,
    )
    report = json.loads(out.read_text())
    assert [r["step"] for r in report] == list(range(steps))
    assert [r["kind"] for r in report] == ["keyframe"] + ["delta"] * (steps - 1)
    for r in report:
        assert r["names"] == sorted([gloo_trainer.UP, gloo_trainer.DOWN, gloo_trainer.HEAD, gloo_trainer.NORM])
        assert r["differ"] == [], r
    assert all(r["changed"] > 0 for r in report[1:])  # training really changed stored bits

    # The same run saved DCP checkpoints (TP DTensors, FSDP2, replicated) at steps 1 and 3:
    # `dcr publish ROOT DCP_DIR` publishes them from their chunks, keyframe then delta.
    dcp_root, state = str(tmp_path / "dcp-bucket"), str(tmp_path / "dcp-r.safetensors")
    for n, s in enumerate((1, 3)):
        rc = main(["publish", dcp_root, str(tmp_path / f"dcp-{s}"), "--step", str(n), "--dcp-prefix", "model.",
                   "--chunk-bytes", "16", "--orchestrator", "none", "-q"])
        assert rc == 0
        run_receive(dcp_root, "r", state)
        assert_bits_equal(read_state(state), read_state(str(tmp_path / f"dcp-{s}.safetensors")))
    m = Catalog(Root(dcp_root)).manifest(1)
    assert m.kind == "delta" and len(m.producer) and m.tensors[gloo_trainer.DOWN].pieces is not None



