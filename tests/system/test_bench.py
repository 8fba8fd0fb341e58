"""Smoke test of ``dcr bench``: it runs end to end and writes well-formed results (no timing checks); the
progress line it prints for an end-to-end refit."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from dcr_bench.bench import e2e_line, main, ratio
from dcr_bench.data import synthetic
from dcr_bench.e2e import e2e_summary


def test_synthetic_update_is_small_steps_plus_specials():
    old, new = synthetic(50_000, 0.05, seed=3)
    assert set(old) == set(new) and all(t.dtype == torch.bfloat16 for t in new.values())
    assert sum(t.numel() for t in old.values()) == 50_000
    o = torch.cat([t.reshape(-1).view(torch.int16) for t in old.values()]).to(torch.int32) & 0xFFFF
    n = torch.cat([t.reshape(-1).view(torch.int16) for t in new.values()]).to(torch.int32) & 0xFFFF
    changed = o != n
    assert 0.03 < changed.float().mean().item() < 0.07
    assert {0x7FC3, 0x8000, 0x7F80} <= set(n[:3].tolist())  # NaN payload, -0.0, +inf
    body = changed.clone()
    body[:4] = False
    steps = (n[body] & 0x7FFF) - (o[body] & 0x7FFF)
    assert steps.abs().max().item() <= 3 and bool(((n[body] ^ o[body]) & 0x8000).eq(0).all())


def _e2e(bandwidth, dcr_s, cli_s, full_s):
    side = {"bytes_stored": 1_000_000, "publish_s": dcr_s / 2, "receive_s": dcr_s / 2, "total_s": dcr_s, "exact": True}
    if bandwidth:
        side["wire_bytes"] = 2_000_000
    return e2e_summary({"backend": "s3" if bandwidth else "local", "bandwidth": bandwidth, "source": "synthetic",
                        "parameters": 200_000, "change_rate": 0.01, "dcr": side,
                        "cli": {"total_s": cli_s, "exact": True}, "full": {"bytes": 40_000_000, "total_s": full_s}})


def test_end_to_end_line_prints_what_was_measured():
    """The progress line of one end-to-end refit: no ``on link`` without a link (was ``on link n/as``),
    and a DCR refit slower than the full copy as a fraction (was ``time x0.0 (commands x0.0)``)."""
    local = e2e_line(_e2e(None, dcr_s=0.46, cli_s=2.3, full_s=0.02))
    assert local == ("  e2e local: DCR in-process 0.46s (publish 0.23 + receive 0.23), as commands 2.30s; full 0.02s; "
                     "bytes x40.0, time x0.043 (commands x0.0087), exact yes"), local
    assert "n/a" not in local and "x0.0 " not in local
    s3 = e2e_line(_e2e(10e6, dcr_s=0.8, cli_s=3.0, full_s=8.4))
    assert s3.startswith("  e2e s3 @ 10 MB/s: DCR in-process 0.80s (publish 0.40 + receive 0.40; on link 0.20s),"), s3
    assert "time x10.5 (commands x2.8)" in s3, s3
    assert [ratio(x) for x in (None, 250.0, 33.3, 4.24, 0.43, 0.0432)] == ["n/a", "x250", "x33.3", "x4.2", "x0.43", "x0.043"]


@pytest.mark.slow  # about 70 s (every section, the scaling commands each a process): with make test-slow
def test_quick_bench_writes_results(tmp_path):
    rc = main(["--quick", "--out", str(tmp_path), "--sizes", "200000", "--rates", "0.01,0.05",
               "--sources", "synthetic", "--backends", "local", "--tensor-counts", "8,200", "--tensor-count-bytes", "1M"])
    assert rc == 0
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["machine"]["cores"] >= 1 and results["command"][:2] == ["dcr", "bench"]
    assert len(results["scenarios"]) == 2
    for s in results["scenarios"]:
        m = s["methods"]
        assert 0 < m["dcr"]["bytes"] < m["full"]["bytes"] == s["full_bytes"]
        assert m["dcr"]["exact"] and s["changed"] > 0
        assert s["bound"]["bytes_per_change"] > 0
        for key in ("standard", "xor_zstd1", "index_value_zstd1"):
            assert m[key]["bytes"] > 0 and m[key]["ratio_to_dcr"] > 0
        assert "patch_from_1" in m and "patch_from_3" in m
    assert {e["backend"] for e in results["end_to_end"]} == {"local"}
    assert all(e["dcr"]["exact"] and e["dcr"]["bytes_stored"] > 0 for e in results["end_to_end"])
    assert all(e["cli"]["exact"] and e["cli"]["total_s"] > 0 for e in results["end_to_end"])  # as dcr commands
    assert results["startup_s"]["local"] > 0
    tp = {(r["column_blocks"], r["tp"]): r for r in results["tp_pulls"]["rows"]}
    assert set(tp) == {(b, t) for b in (1, 4) for t in (1, 2, 4)} and all(r["exact"] for r in tp.values())
    assert tp[(4, 1)]["share_ratio"] == [1.0] and len(tp[(4, 4)]["pulled_bytes"]) == 4
    c = results["commands"]
    assert c["publish_best_s"] > 0 and set(c["startup_s"]) == {"ls", "verify", "receive"}
    sc = results["scaling"]["rows"]
    assert [r["pattern"] for r in sc] == (["fixed rate"] * 2 + ["fixed change"] * 2 + ["frozen 3/4"] * 2
                                          + ["fixed change, clustered"] * 2)
    assert all(r["exact"] for r in sc)
    assert sc[2]["changed"] == sc[3]["changed"] < sc[1]["changed"] and sc[0]["bytes"] < sc[1]["bytes"]
    assert sc[6]["changed"] == sc[7]["changed"] == sc[2]["changed"]
    assert all(r["receive_in_place_writeback_s"] >= 0 and r["publish_delta_writeback_s"] >= 0 for r in sc)
    tc = results["tensor_counts"]["rows"]
    assert [(r["tensors"], r["backend"]) for r in tc] == [(8, "local"), (200, "local")] and all(r["exact"] for r in tc)
    md = (tmp_path / "results.md").read_text()
    assert "Bytes per changed element" in md and "End to end" in md and "Cost against tensor count" in md
    assert "Per-rank pulls" in md and "zstd -q -1 -T1" in md and "Cost against model size" in md
    if importlib.util.find_spec("matplotlib") is not None:
        assert (tmp_path / "bytes_per_change.png").stat().st_size > 0
        assert (tmp_path / "tensor_counts.png").stat().st_size > 0
    else:
        assert results["plots_skipped"]


@pytest.mark.slow  # about 17 s: the quick bench above covers the command in the default run
def test_bench_end_to_end_through_s3_at_two_link_caps(tmp_path):
    for mod in ("moto", "boto3", "s3fs", "flask"):
        if importlib.util.find_spec(mod) is None:
            pytest.skip(f"{mod} is not installed")
    rc = main(["--out", str(tmp_path), "--sizes", "200000", "--rates", "0.05", "--sources", "synthetic",
               "--backends", "s3", "--bandwidth", "50e6,20e6", "--scaling-sizes", "0",
               "--tensor-counts", "0"])  # no GB checkpoints here; the tensor counts on S3: test_bench_tensor_counts
    assert rc == 0
    results = json.loads((tmp_path / "results.json").read_text())
    e2e = results["end_to_end"]
    assert [e["bandwidth"] for e in e2e] == [50e6, 20e6]
    for e in e2e:
        assert e["dcr"]["exact"] and e["cli"]["exact"]
        # both directions of the delta crossed the capped link: at least the stored bytes, up and down
        assert e["dcr"]["wire_bytes"] >= 2 * e["dcr"]["bytes_stored"] > 0
        assert e["full"]["wire_bytes"] >= 2 * e["full"]["bytes"]
        assert e["dcr"]["link_s"] > 0 and e["dcr"]["server_cpu_s"] >= 0 and e["byte_ratio"] > 1
        kinds = e["dcr"]["request_kinds"]  # every request counted once, by what it touched
        assert sum(kinds.values()) == e["dcr"]["requests"] and kinds["PUT pack"] == kinds["GET pack"] > 0
        assert not any(k.endswith(" chunk") for k in kinds)  # packed steps: no object per chunk
        assert kinds["PUT manifest.json"] == kinds["PUT commit.json"] == 1
    md = (tmp_path / "results.md").read_text()
    assert "server CPU s" in md and "Requests of the in-process refit, by what they touch" in md
