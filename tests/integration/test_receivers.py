"""Validates the reference receivers themselves: their placements are exactly what the test's inverses undo."""

from __future__ import annotations

import random

import pytest
import torch

from dcr_bench.models.llama_vllm import LlamaConfig, VllmLlama, canonical_checkpoint, padded_vocab, tp_group
from tests.support.receivers.hf import HFReceiver, greedy_tokens, tiny_hf_llama
from tests.support.receivers.hf import canonical_checkpoint as hf_checkpoint
from tests.support.receivers.quantized import (
    FP8,
    Fp8BlockQuantized,
    OffsetNorm,
    RechunkedExperts,
    dequantize_fp8_blocks,
    is_norm,
)

CONFIGS = {
    "gqa": LlamaConfig(),
    "tied": LlamaConfig(tie_word_embeddings=True),
    "kv4": LlamaConfig(num_kv_heads=4),
}
CASES = [(c, tp) for c in CONFIGS for tp in (1, 2, 4)]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


def snapshot(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every param and buffer, cloned, so later loads can't alias it."""
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def assert_same_state(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    bad = [k for k in a if not same_bits(a[k], b[k])]
    assert not bad, f"bits differ: {bad}"


def group_state(ranks) -> list[dict[str, torch.Tensor]]:
    return [snapshot(r) for r in ranks]


def dense_group(cfg: LlamaConfig, tp: int, ckpt) -> list[VllmLlama]:
    ranks = tp_group(cfg, tp)
    for r in ranks:
        r.load_weights(ckpt.items())
    return ranks


# ---- inverse placement for the vLLM Llama --------------------------------------------------------------

def _kv_heads_of_rank(cfg: LlamaConfig, tp: int, rank: int) -> list[int]:
    if tp >= cfg.num_kv_heads:
        return [rank * cfg.num_kv_heads // tp]
    per = cfg.num_kv_heads // tp
    return list(range(rank * per, (rank + 1) * per))


def _unreplicate_kv(cfg: LlamaConfig, tp: int, slices: list[torch.Tensor]) -> torch.Tensor:
    """Rebuild [num_kv * hd, H] from per-rank kv slices; replicas of one head must carry identical bits."""
    hd = cfg.head_dim
    heads: dict[int, torch.Tensor] = {}
    for rank, s in enumerate(slices):
        for j, h in enumerate(_kv_heads_of_rank(cfg, tp, rank)):
            piece = s[j * hd:(j + 1) * hd]
            if h in heads:
                assert same_bits(heads[h], piece), f"kv head {h} replicas differ"
            heads[h] = piece
    assert sorted(heads) == list(range(cfg.num_kv_heads))
    return torch.cat([heads[h] for h in range(cfg.num_kv_heads)])


def _unpad_vocab(cfg: LlamaConfig, tp: int, shards: list[torch.Tensor]) -> torch.Tensor:
    full = torch.cat(shards)
    assert full.shape[0] == padded_vocab(cfg.vocab_size, tp)
    pad = full[cfg.vocab_size:]
    assert same_bits(pad, torch.zeros_like(pad)), "vocab padding rows must stay zero"
    return full[:cfg.vocab_size]


def _replicated(states: list[dict], key: str) -> torch.Tensor:
    first = states[0][key]
    assert all(same_bits(first, s[key]) for s in states[1:]), f"{key} not replicated"
    return first


def reconstruct(cfg: LlamaConfig, ranks: list[VllmLlama]) -> dict[str, torch.Tensor]:
    """The canonical checkpoint, rebuilt from rank params by undoing vLLM's placement."""
    tp = len(ranks)
    states = group_state(ranks)
    hd = cfg.head_dim
    q_size = cfg.num_heads // tp * hd
    kv_size = len(_kv_heads_of_rank(cfg, tp, 0)) * hd
    inter = cfg.intermediate_size // tp
    out = {"model.embed_tokens.weight": _unpad_vocab(cfg, tp, [s["model.embed_tokens.weight"] for s in states])}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}"
        qkv = [s[f"{p}.self_attn.qkv_proj.weight"] for s in states]
        gu = [s[f"{p}.mlp.gate_up_proj.weight"] for s in states]
        out[f"{p}.self_attn.q_proj.weight"] = torch.cat([t[:q_size] for t in qkv])
        out[f"{p}.self_attn.k_proj.weight"] = _unreplicate_kv(cfg, tp, [t[q_size:q_size + kv_size] for t in qkv])
        out[f"{p}.self_attn.v_proj.weight"] = _unreplicate_kv(cfg, tp, [t[q_size + kv_size:] for t in qkv])
        out[f"{p}.self_attn.o_proj.weight"] = torch.cat([s[f"{p}.self_attn.o_proj.weight"] for s in states], 1)
        out[f"{p}.mlp.gate_proj.weight"] = torch.cat([t[:inter] for t in gu])
        out[f"{p}.mlp.up_proj.weight"] = torch.cat([t[inter:] for t in gu])
        out[f"{p}.mlp.down_proj.weight"] = torch.cat([s[f"{p}.mlp.down_proj.weight"] for s in states], 1)
        for n in ("input_layernorm", "post_attention_layernorm"):
            out[f"{p}.{n}.weight"] = _replicated(states, f"{p}.{n}.weight")
    out["model.norm.weight"] = _replicated(states, "model.norm.weight")
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = _unpad_vocab(cfg, tp, [s["lm_head.weight"] for s in states])
    out["model.rotary_emb.inv_freq"] = _replicated(states, "model.rotary_emb.inv_freq")
    return out


# ---- vLLM-style Llama --------------------------------------------------------------------------------

@pytest.mark.parametrize("cfg_name,tp", CASES)
def test_llama_dense_load_inverts_to_canonical(cfg_name, tp):
    cfg = CONFIGS[cfg_name]
    ckpt = canonical_checkpoint(cfg, seed=1)
    assert_same_state(reconstruct(cfg, dense_group(cfg, tp, ckpt)), ckpt)


@pytest.mark.parametrize("cfg_name,tp", CASES)
def test_llama_reload_order_and_subsets_give_same_bits(cfg_name, tp):
    cfg = CONFIGS[cfg_name]
    ckpt = canonical_checkpoint(cfg, seed=2)
    want = group_state(dense_group(cfg, tp, ckpt))

    # The same checkpoint twice into the same ranks.
    ranks = dense_group(cfg, tp, ckpt)
    for r in ranks:
        r.load_weights(ckpt.items())
    for a, b in zip(group_state(ranks), want):
        assert_same_state(a, b)

    # Shuffled order, and one name per call (DCR loads subsets of names).
    items = list(ckpt.items())
    random.Random(tp).shuffle(items)
    shuffled, one_by_one = tp_group(cfg, tp), tp_group(cfg, tp)
    for r in shuffled:
        r.load_weights(iter(items))
    for r in one_by_one:
        for item in items:
            r.load_weights([item])
    for ranks in (shuffled, one_by_one):
        for a, b in zip(group_state(ranks), want):
            assert_same_state(a, b)


@pytest.mark.parametrize("cfg_name,tp", [("gqa", 4), ("tied", 2)])
def test_llama_refit_overwrites_every_bit(cfg_name, tp):
    # A refit over an older checkpoint must leave no trace of it: same bits as a fresh load.
    cfg = CONFIGS[cfg_name]
    old, new = canonical_checkpoint(cfg, seed=3), canonical_checkpoint(cfg, seed=4)
    ranks = dense_group(cfg, tp, old)
    for r in ranks:
        r.load_weights(new.items())
    for a, b in zip(group_state(ranks), group_state(dense_group(cfg, tp, new))):
        assert_same_state(a, b)


def test_llama_params_are_frozen_and_tied_has_no_lm_head():
    cfg = CONFIGS["tied"]
    rank = VllmLlama(cfg, 0, 2)
    params = dict(rank.named_parameters())
    assert all(not p.requires_grad for p in params.values())
    assert "lm_head.weight" not in params
    assert "lm_head.weight" not in canonical_checkpoint(cfg, 0)
    # A tied checkpoint that still carries lm_head.weight is accepted and the extra tensor ignored.
    ckpt = canonical_checkpoint(cfg, 0)
    extra = {**ckpt, "lm_head.weight": torch.ones_like(ckpt["model.embed_tokens.weight"])}
    rank.load_weights(extra.items())
    assert_same_state(snapshot(rank), snapshot(dense_group(cfg, 2, ckpt)[0]))


def test_llama_rejects_unknown_names():
    rank = VllmLlama(CONFIGS["gqa"])
    with pytest.raises(KeyError):
        rank.load_weights([("model.layers.9.mlp.gate_proj.weight", torch.zeros(96, 64, dtype=torch.bfloat16))])
    with pytest.raises(KeyError):
        rank.load_weights([("model.bogus.weight", torch.zeros(64, dtype=torch.bfloat16))])


# ---- FP8 block quantization (not bit-preserving) -----------------------------------------------------

def test_fp8_dense_load_is_deterministic_and_quantizes():
    ckpt = canonical_checkpoint(CONFIGS["gqa"], seed=5)
    a, b = Fp8BlockQuantized.from_checkpoint(ckpt), Fp8BlockQuantized.from_checkpoint(ckpt)
    a.load_weights(ckpt.items())
    items = list(ckpt.items())
    random.Random(0).shuffle(items)
    for item in items:
        b.load_weights([item])
    assert_same_state(snapshot(a), snapshot(b))
    a.load_weights(ckpt.items())
    assert_same_state(snapshot(a), snapshot(b))

    params = dict(a.named_parameters())
    assert all(not p.requires_grad for p in params.values())
    for name, t in ckpt.items():
        if t.dim() == 2:
            q, scale = params[name], params[name + "_scale"]
            assert q.dtype == FP8 and scale.dtype == torch.float32
            assert scale.shape == (-(-t.shape[0] // 32), -(-t.shape[1] // 32))
            # A sanity bound on the quantization, not a bit check: e4m3 keeps 3 mantissa bits (<= 1/16 rel).
            err = (dequantize_fp8_blocks(q, scale) - t.float()).abs()
            assert bool((err <= t.float().abs() / 15 + scale.max() * 2 ** -9).all()), name
            assert torch.isfinite(scale).all()
        else:
            assert same_bits(params[name], t), name


def test_fp8_zero_block_has_finite_scale():
    rec = Fp8BlockQuantized([("w", (40, 70)), ("n", (5,), torch.float32)])
    w = torch.zeros(40, 70, dtype=torch.bfloat16)
    w[35:, 65:] = 3.0
    rec.load_weights([("w", w), ("n", torch.arange(5.0))])
    assert torch.equal(rec.w_scale, torch.where(torch.arange(6).reshape(2, 3) == 5, 3 / 448, 1.0).float())
    assert torch.equal(rec.dequantized("w"), w.float())
    assert same_bits(rec.n, torch.arange(5.0))


# ---- OffsetNorm (arithmetic) -------------------------------------------------------------------------

def test_offset_norm_round_trips_via_inverse():
    ckpt = canonical_checkpoint(CONFIGS["gqa"], seed=6)
    rec = OffsetNorm.from_checkpoint(ckpt)
    rec.load_weights(ckpt.items())
    params = dict(rec.named_parameters())
    norms = [k for k in ckpt if is_norm(k)]
    assert norms and "model.rotary_emb.inv_freq" not in norms
    for name, t in ckpt.items():
        stored = params[name]
        if is_norm(name):
            # Inverse: + 1 in F32, cast back. Exact here because bf16 norms near 1 keep w - 1 representable.
            assert same_bits((stored.float() + 1.0).to(t.dtype), t), name
            assert not same_bits(stored, t), name
        else:
            assert same_bits(stored, t), name


def test_offset_norm_is_not_bit_preserving_in_general():
    # Far from 1, w - 1 rounds in bf16, so the stored bits cannot give w back: DCR must not assume placement.
    w = torch.tensor([1e-3, 300.0, 1.0], dtype=torch.bfloat16)
    rec = OffsetNorm([("norm.weight", (3,))])
    rec.load_weights([("norm.weight", w)])
    back = (rec.norm.weight.float() + 1.0).to(torch.bfloat16)
    assert not same_bits(back, w)


# ---- RechunkedExperts (pure placement, not a copy) ---------------------------------------------------

def unchunk(rec: RechunkedExperts) -> dict[str, torch.Tensor]:
    half, h, e_n = rec.intermediate // 2, rec.hidden, rec.num_experts
    out = {}
    for e in range(e_n):
        block = rec.w1.data[(e_n - 1 - e) * half:(e_n - e) * half]
        out[f"experts.{e}.w1.weight"] = torch.cat([block[:, :h], block[:, h:]])
    return out


def test_rechunked_experts_round_trip_and_permutes_bits():
    ckpt = RechunkedExperts.checkpoint(seed=7)
    rec = RechunkedExperts()
    rec.load_weights(ckpt.items())
    assert_same_state(unchunk(rec), ckpt)
    assert rec.w1.shape == (4 * 8, 16) and not rec.w1.requires_grad
    # A permutation of bits: same multiset of bytes, different order from a plain concatenation.
    flat = torch.cat([bits(t) for t in ckpt.values()])
    assert torch.equal(bits(rec.w1).sort().values, flat.sort().values)
    assert not torch.equal(bits(rec.w1), flat)

    items = list(ckpt.items())[::-1]
    other = RechunkedExperts()
    for item in items:
        other.load_weights([item])
    assert same_bits(other.w1, rec.w1)
    with pytest.raises(KeyError):
        rec.load_weights([("experts.4.w1.weight", ckpt["experts.0.w1.weight"])])


# ---- Hugging Face receiver ---------------------------------------------------------------------------

@pytest.mark.parametrize("tie", [False, True])
def test_hf_receiver_takes_another_models_bits(tie):
    source = tiny_hf_llama(seed=0, tie=tie)
    ckpt = hf_checkpoint(source)
    rec = HFReceiver(tiny_hf_llama(seed=1, tie=tie))
    assert not all(same_bits(ckpt[k], v) for k, v in rec.model.state_dict().items())
    rec.load_weights(ckpt.items())
    assert_same_state(hf_checkpoint(rec), ckpt)

    prompt = [1, 17, 42, 5]
    tokens = greedy_tokens(rec, prompt, 8)
    assert len(tokens) == 8
    assert tokens == greedy_tokens(rec, prompt, 8) == greedy_tokens(source, prompt, 8)


def test_hf_receiver_subsets_and_unknown_keys():
    ckpt = hf_checkpoint(tiny_hf_llama(seed=2))
    rec = HFReceiver(seed=3)
    for item in reversed(list(ckpt.items())):
        rec.load_weights([item])
    assert_same_state(hf_checkpoint(rec), ckpt)
    with pytest.raises(KeyError):
        rec.load_weights([("model.bogus.weight", torch.zeros(3))])
