"""``dcr publish ROOT DCP_DIR``: torch.distributed.checkpoint directories published from their chunks."""

from __future__ import annotations

import json
import os
import pickle
import warnings

import pytest
import torch

from dcr_core.errors import InvalidCheckpointError
from flows import run_receive
from flows.cli import main
from flows.publish.dcp import dcp_sources
from storage.local.dcp_metadata import is_dcp_dir, read_dcp_metadata
from tests.support.helpers import assert_bits_equal, nasty_tensor, next_step, read_state

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
        assert_bits_equal(read_state(state), ck)


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


def test_cli_publishes_per_rank_safetensors_with_a_layout_file(tmp_path, monkeypatch):
    """Megatron-style rank files (fused QKV with GQA, gated fc1, row parallel, FP32 master cast to
    BF16, replicated norm kept as w-1) + a layout file -> the canonical checkpoint, bit exact."""
    from dcr_core.conversion import cast, offset
    from dcr_core.shard_spec import fused_qkv, gated_fc1
    from tests.support.helpers import write_safetensors
    from tests.support.shard_helpers import cut

    monkeypatch.setenv("DCR_CACHE_DIR", str(tmp_path / "cache"))
    nh, ng, hd, h, ffn, tp = 4, 2, 2, 6, 8, 2
    torch.manual_seed(0)

    def masters(seed):
        g = torch.Generator().manual_seed(seed)
        return {
            "q": torch.randn(nh * hd, h, generator=g), "k": torch.randn(ng * hd, h, generator=g),
            "v": torch.randn(ng * hd, h, generator=g), "gate": torch.randn(ffn, h, generator=g),
            "up": torch.randn(ffn, h, generator=g), "down": torch.randn(h, ffn, generator=g),
            "norm_m1": torch.randn(h, generator=g) * 0.01,
        }

    names = {"q": "l0.q_proj.weight", "k": "l0.k_proj.weight", "v": "l0.v_proj.weight",
             "gate": "l0.gate_proj.weight", "up": "l0.up_proj.weight", "down": "l0.down_proj.weight"}

    def write_ranks(m, d):
        d.mkdir()
        canon32 = {names[k]: m[k].numpy().reshape(-1) for k in names}
        layout = {"format": "dcr-shard-layout", "world": tp, "ranks": []}
        for t in range(tp):
            qkv = fused_qkv(names["q"], names["k"], names["v"], nh, ng, hd, (h,), t, tp)
            fc1 = gated_fc1(names["gate"], names["up"], ffn, (h,), t, tp)
            f = ffn // tp
            tensors = {
                "linear_qkv": torch.from_numpy(cut(canon32, qkv, sum(p.numel for p in qkv), "float32")).reshape(-1, h),
                "linear_fc1": torch.from_numpy(cut(canon32, fc1, 2 * f * h, "float32")).reshape(2 * f, h),
                "linear_fc2": m["down"][:, t * f:(t + 1) * f].contiguous(),
                "norm": m["norm_m1"].clone(),
            }
            write_safetensors(d / f"rank{t}.safetensors", tensors)
            qkv_pl = {"kind": "fused_qkv", "q": names["q"], "k": names["k"], "v": names["v"], "num_heads": nh,
                      "num_groups": ng, "head_dim": hd, "rest": [h], "tp_rank": t, "tp": tp}
            layout["ranks"].append({"file": f"rank{t}.safetensors", "shards": [
                {"name": "linear_qkv", "placement": qkv_pl, "conversion": "bf16"},
                {"name": "linear_fc1", "conversion": "bf16", "placement": {
                    "kind": "gated_fc1", "gate": names["gate"], "up": names["up"], "ffn": ffn, "rest": [h], "tp_rank": t, "tp": tp}},
                {"name": "linear_fc2", "conversion": "bf16", "placement": {
                    "kind": "split", "tensor": names["down"], "shape": [h, ffn], "splits": {"1": [t, tp]}}},
                {"name": "norm", "conversion": "norm_minus_one_bf16", "placement": {
                    "kind": "replicate", "tensor": "l0.norm.weight", "shape": [h], "rank": t}},
            ]})
        (d / "layout.json").write_text(json.dumps(layout))
        want = {names[k]: cast(torch.bfloat16)(m[k]) for k in names}
        want["l0.norm.weight"] = offset(1.0, torch.bfloat16)(m["norm_m1"])
        return d / "layout.json", want

    root, state = str(tmp_path / "bucket"), str(tmp_path / "r.safetensors")
    m0 = masters(0)
    m1 = {k: v + 0.01 * torch.randn_like(v) for k, v in m0.items()}
    for step, m in enumerate((m0, m1)):
        path, want = write_ranks(m, tmp_path / f"ranks-{step}")
        assert main(["publish", root, str(path), "--step", str(step), "--chunk-bytes", "24", "--orchestrator", "none", "-q"]) == 0
        run_receive(root, "r", state)
        assert_bits_equal(read_state(state), want)
