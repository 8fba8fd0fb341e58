"""The embedded demo runs end to end on a tiny model and every refit is bit-exact."""

import json

import pytest
import torch

from dcr_bench.demo import ModelConfig, main, mismatch, run_demo

TINY = ModelConfig(vocab=512, hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, seq_len=16, batch=4)


def test_run_demo_is_exact_and_deltas_are_small(tmp_path):
    # A larger lr than the default so the tiny model's BF16 weights do change every step.
    s = run_demo(str(tmp_path / "bucket"), str(tmp_path / "work"), steps=3, lr=1e-5, config=TINY, verbose=False)
    assert s["exact"] and s["mismatch"] is None
    assert [r["kind"] for r in s["rows"]] == ["keyframe", "delta", "delta", "delta"]
    assert all(r["exact"] for r in s["rows"])
    for r in s["rows"][1:]:
        assert 0 < r["elements_changed"] < r["elements"]
        assert r["bytes_stored"] < r["bytes_full"]
    assert s["delta_bytes_stored"] < s["checkpoint_bytes"]


def test_main_writes_json_and_reruns_over_its_own_workdir(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("dcr_bench.demo.ModelConfig", lambda: TINY)
    work, out = tmp_path / "demo", tmp_path / "summary.json"
    for _ in range(2):  # the second run wipes the first run's workdir and root
        assert main(["--workdir", str(work), "--steps", "1", "--lr", "1e-5", "--json", str(out)]) == 0
    summary = json.loads(out.read_text())
    assert summary["exact"] and summary["steps"] == 1
    assert "exact" in capsys.readouterr().out


def test_main_refuses_a_foreign_workdir(tmp_path):
    (tmp_path / "keep.txt").write_text("x")
    with pytest.raises(SystemExit, match="--fresh"):
        main(["--workdir", str(tmp_path), "--steps", "1"])
    assert (tmp_path / "keep.txt").exists()


def test_mismatch_names_the_tensor():
    a = {"w": torch.zeros(4, dtype=torch.bfloat16), "b": torch.ones(2)}
    assert mismatch(a, dict(a)) is None
    flipped = a["w"].clone()
    flipped.view(torch.int16)[2] ^= 1
    assert mismatch(a, {**a, "w": flipped}).startswith("w:")
    assert "b" in mismatch(a, {"w": a["w"]})
    assert mismatch(a, {**a, "b": torch.ones(2, dtype=torch.float64)}).startswith("b:")
