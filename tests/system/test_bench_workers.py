"""``python -m dcr_bench.workers_scaling`` (``make bench-workers``) end to end on a small checkpoint:
every configuration publishes a delta through its own ``dcr publish`` process (in one process and on
a LocalCluster of 1 and 2 workers, against the Prefect server the benchmark starts), each file gets
one policy digest whichever configuration published it, and the results, the table and the plot
are written."""

from __future__ import annotations

import json
import os

import pytest

from dcr_bench.workers_scaling import main

pytestmark = [pytest.mark.slow]


def test_workers_bench_publishes_in_every_configuration_and_they_agree(tmp_path):
    out = tmp_path / "out"
    assert main(["--out", str(out), "--size", "2e7", "--repeats", "1", "--tasks", "4"]) == 0
    res = json.loads((out / "results.json").read_text())
    pub = res["publish"]
    assert pub["exact"]
    expected = ["one process, 1 core", "--workers 1, 1 core"]
    if len(os.sched_getaffinity(0)) >= 2:
        expected = ["one process, 1 core", "one process, 2 cores", "--workers 1, 1 core", "--workers 2, 2 cores"]
    assert pub["configs"] == expected
    assert [r["config"] for r in pub["runs"]] == expected
    assert all(r["kind"] == "delta" and r["encode_s"] > 0 and abs(r["change_rate"] - 0.03) < 1e-3 for r in pub["runs"])
    # the same file, the same policy, whichever configuration published it
    assert len({r["policy_digest"] for r in pub["runs"] if r["file"] == "new.safetensors"}) == 1
    assert res["overhead"]["tasks"] == 4 and res["overhead"]["prefect_s"] > 0 and res["overhead"]["dask_s"] > 0
    assert [p["machines"] for p in res["summary"]["projection"]["rows"]] == [1, 8, 32, 128]
    md = (out / "results.md").read_text()
    assert all(c in md for c in expected)
    assert res["plot"] is None or os.path.getsize(res["plot"]) > 0
