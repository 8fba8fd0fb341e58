"""``dcr bench``'s cost against tensor count: the MoE-shaped checkpoints it publishes (their bits) and
the fields the section writes (no timing checks)."""

from __future__ import annotations

import importlib.util
import math

import numpy as np
import pytest

from dcr_bench import moe, tensor_counts
from dcr_bench.bench import build_parser, resolve
from dcr_bench.e2e import S3Service
from storage.local.safetensors import SafetensorsCheckpoint

KINDS = {"PUT", "GET", "LIST", "HEAD", "DELETE"}


@pytest.mark.parametrize("n", [1, 8, 16, 17, 200, 1000, 10000, 70000])
def test_moe_layout_holds_the_count_in_the_same_bytes(n):
    shapes = moe.layout(75_000_000, n)
    assert len(shapes) == len({name for name, _ in shapes}) == n
    assert abs(2 * sum(math.prod(s) for _, s in shapes) - 75_000_000) < 0.002 * 75_000_000
    if n > moe.PLAIN_MAX:
        names = [name for name, _ in shapes]
        layers = max(1, n // moe.LAYER_TENSORS)  # each with q/k/v/o, two norms and a router
        assert sum(".mlp.experts." in x for x in names) == n - 7 * layers
        assert sum(".self_attn.q_proj." in x for x in names) == sum(".mlp.gate.weight" in x for x in names) == layers


def test_moe_pair_changes_the_rate_of_elements_by_one_unit(tmp_path):
    old, new = str(tmp_path / "old.safetensors"), str(tmp_path / "new.safetensors")
    info = moe.write_pair(old, new, 1_000_000, 200, rate=0.03, seed=5)
    assert info["tensors"] == 200 and info["bytes"] == 2 * info["elements"]
    changed = 0
    with SafetensorsCheckpoint(old) as a, SafetensorsCheckpoint(new) as b:
        assert list(a.infos) == [name for name, _ in moe.layout(1_000_000, 200)] and a.infos == b.infos
        assert {i.dtype for i in a.infos.values()} == {"BF16"}
        for name in a.infos:
            x, y = a.bits(name), b.bits(name)
            step = (y.astype(np.int32) - x.astype(np.int32)) % (1 << 16)
            assert set(np.unique(step).tolist()) <= {0, 1, (1 << 16) - 1}  # one unit up or down, or unchanged
            changed += int((step != 0).sum())
    assert changed == info["changed"] and 0.02 < changed / info["elements"] < 0.04
    moe.write_pair(str(tmp_path / "old2"), str(tmp_path / "new2"), 1_000_000, 200, rate=0.03, seed=5)
    assert (tmp_path / "old2").read_bytes() == (tmp_path / "old.safetensors").read_bytes()  # the same seed:
    assert (tmp_path / "new2").read_bytes() == (tmp_path / "new.safetensors").read_bytes()  # the same bits


def test_tensor_counts_option_and_defaults():
    a = resolve(build_parser().parse_args(["--tensor-counts", "8,1000,10000", "--tensor-count-bytes", "2M"]))
    assert a.tensor_counts == [8, 1000, 10000] and a.tensor_count_bytes == 2_000_000
    a = resolve(build_parser().parse_args([]))
    assert a.tensor_counts == list(tensor_counts.DEFAULT_COUNTS) and a.tensor_count_bytes == tensor_counts.DEFAULT_BYTES
    a = resolve(build_parser().parse_args(["--quick", "--tensor-counts", "0"]))
    assert a.tensor_counts == [0] and a.tensor_count_bytes == tensor_counts.QUICK_BYTES
    assert a.tensor_count_bundle_below is None
    assert build_parser().parse_args(["--tensor-count-bundle-below", "0"]).tensor_count_bundle_below == 0
    assert build_parser().parse_args(["--tensor-count-bundle-below", "1048576"]).tensor_count_bundle_below == 1 << 20


def _check(res: dict, counts: list[int], backends: list[str]) -> None:
    assert res["counts"] == counts and res["backends"] == backends and res["total_bytes"] == 1_000_000
    assert res["ratio_base_tensors"] == min(counts)
    assert [c["tensors"] for c in res["checkpoints"]] == counts
    rows = res["rows"]
    assert [(r["tensors"], r["backend"]) for r in rows] == [(n, b) for n in counts for b in backends]
    for r in rows:
        assert r["exact"] and isinstance(r["schema_version"], int)
        assert r["publish_s"] > 0 and r["receive_s"] > 0 and r["keyframe_s"] > 0
        assert r["publish_ratio"] > 0 and r["receive_ratio"] > 0
        q = r["requests"]
        for side in ("publish", "receive", "refit"):
            assert set(q[side]) == KINDS | {"total", "retries"}
            assert q[side]["total"] == sum(q[side][k] for k in KINDS)
        assert all(q["refit"][k] == q["publish"][k] + q["receive"][k] for k in KINDS)
        assert q["publish"]["PUT"] >= r["objects_written"] > 0 and q["receive"]["GET"] > 0
        assert 0 < r["bytes_stored"] <= r["objects_bytes"] and r["bytes_pulled"] > 0
        assert r["changed"] > 0 and abs(r["bytes"] - 1_000_000) < 10_000
        b = r["bound"]
        assert b["objects"] == 16 + r["bytes_stored"] / (8 << 20)
        assert b["receive_gets"] == 16 + r["bytes_pulled"] / (8 << 20)
        assert b["objects_ok"] == (r["objects_written"] <= b["objects"])
        assert b["receive_gets_ok"] == (q["receive"]["GET"] <= b["receive_gets"])
        for phase in ("setup", "publish", "receive"):  # each phase's own process
            assert r["peak_rss_bytes"][phase] >= r["start_rss_bytes"][phase] > 0
    for backend in backends:
        first = next(r for r in rows if r["backend"] == backend)
        assert first["publish_ratio"] == first["receive_ratio"] == 1.0
    for backend in backends:  # (most - fewest) / difference in count
        lo, hi = (next(r for r in rows if r["backend"] == backend and r["tensors"] == n) for n in (min(counts), max(counts)))
        want = {k: (hi[f"{k}_s"] - lo[f"{k}_s"]) / (max(counts) - min(counts)) for k in ("publish", "receive")}
        assert res["per_tensor_s"][backend] == want
    md = "\n".join(tensor_counts.markdown(res))
    assert "Cost against tensor count" in md and md.count("| yes |") == len(rows) and "Per tensor beyond the bytes" in md


def test_tensor_count_section_on_a_local_root(tmp_path):
    res = tensor_counts.measure(str(tmp_path), [8, 200], ["local"], total_bytes=1_000_000, bundle_below=0)
    _check(res, [8, 200], ["local"])
    assert res["bundle_below"] == 0 and {r["schema_version"] for r in res["rows"]} == {3}  # no bundles: schema 3
    assert "--bundle-below 0" in "\n".join(tensor_counts.markdown(res))
    if importlib.util.find_spec("matplotlib") is not None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        path = tensor_counts.plot(res, str(tmp_path), plt)
        assert path.endswith("tensor_counts.png") and (tmp_path / "tensor_counts.png").stat().st_size > 0


@pytest.mark.slow  # about 25 s: a moto server and a process per phase
def test_tensor_count_section_on_s3(tmp_path):
    for mod in ("moto", "boto3", "s3fs", "flask"):
        if importlib.util.find_spec(mod) is None:
            pytest.skip(f"{mod} is not installed")
    with S3Service(50e6) as s3:
        res = tensor_counts.measure(str(tmp_path), [8, 200], ["local", "s3"], s3, total_bytes=1_000_000)
        left = s3.fs(s3.direct).ls(s3.bucket)
    _check(res, [8, 200], ["local", "s3"])
    assert not [p for p in left if "tensor-counts-" in p]  # every ROOT removed from the server


@pytest.mark.slow  # about 10 s: eight dcr commands, each its own process
def test_command_times_runs_the_commands_and_reports_medians(tmp_path):
    from dcr_bench import command_times

    res = command_times.measure(str(tmp_path), [8, 300], runs=1, total_bytes=1_000_000, log=lambda _: None)
    assert [r["tensors"] for r in res["rows"]] == [8, 300] and all(r["exact"] for r in res["rows"])
    for r in res["rows"]:
        for c in ("publish", "receive"):
            assert len(r[c]["runs_s"]) == 1 and r[c]["median_s"] == r[c]["fastest_s"] > 0
    assert res["rows"][0]["publish"]["ratio"] == res["rows"][0]["receive"]["ratio"] == 1.0
    assert "| 300 |" in command_times.markdown(res)
