"""Refits of live modules through their own loaders equal a dense load, bit for bit, every step."""

from __future__ import annotations

import uuid

import numpy as np
import pytest
import torch

from dcr_bench.models.llama_vllm import LlamaConfig, VllmLlama, canonical_checkpoint, tp_group
from dcr_core.chunking import ChunkGrid
from flows import receive_into_module, run_publish
from flows.options import PublishOptions
from flows.receive import placement
from tests.support.helpers import assert_bits_equal, module_bits
from tests.support.module_faults import fail_mid_apply
from tests.support.receivers.hf import HFReceiver, greedy_tokens
from tests.support.receivers.hf import canonical_checkpoint as hf_checkpoint
from tests.support.receivers.quantized import Fp8BlockQuantized, OffsetNorm, RechunkedExperts, is_norm


def _evolve(ck: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """Next step: ~2% of BF16 bits flip (sign flips of zeros, NaN payloads included); buffers stay."""
    g = torch.Generator().manual_seed(seed)
    out = {n: t.clone() for n, t in ck.items()}
    for t in out.values():
        if t.dtype != torch.bfloat16:
            continue
        bits = t.view(-1).view(torch.int16)
        mask = torch.rand(bits.numel(), generator=g) < 0.02
        bits[mask] ^= torch.randint(1, 4, (int(mask.sum()),), generator=g, dtype=torch.int16)
        if seed % 2 and bits.numel() > 3:
            bits[0] = 0x7FC1 + seed  # a NaN with a distinct payload
            bits[1] ^= -0x8000  # sign flip (+0.0 <-> -0.0 where it was zero)
    return out


def _publish_chain(root, first, steps, tmp_path):
    cks = [first]
    for s in range(1, steps):
        cks.append(_evolve(cks[-1], s))
    opts = PublishOptions(chunk_bytes=2048, cache_dir=str(tmp_path / "pub-cache"))
    for s, ck in enumerate(cks):
        run_publish(root, ck, s, options=opts)
    return cks


def _dense(factory, ck):
    m = factory()
    m.load_weights(list(ck.items()))
    return module_bits(m)


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_vllm_style_tp_ranks_refit_exactly_forward_and_backward(tp, tie, tmp_path):
    cfg = LlamaConfig(num_kv_heads=2, tie_word_embeddings=tie)  # tp=4 > 2 kv heads: replicated
    root = f"memory://mod-{uuid.uuid4().hex}"
    first = canonical_checkpoint(cfg, seed=0)
    if tie:
        first.pop("lm_head.weight", None)
    cks = _publish_chain(root, first, 4, tmp_path)
    ranks = tp_group(cfg, tp)
    for step in [0, 1, 2, 3, 1, 3, 0]:
        for r, mod in enumerate(ranks):
            res = receive_into_module(root, f"rank{r}", mod, step, state_path=str(tmp_path / f"m{r}.safetensors"))
            assert res["step"] == step
            assert_bits_equal(module_bits(mod), _dense(lambda r=r: VllmLlama(cfg, r, tp), cks[step]))
    table = ranks[0]._dcr_probe
    assert table.names(placement.OVERWRITE) == []
    assert res["mode"] in ("delta", "dense")


def test_refits_after_the_first_take_the_direct_xor_path_and_report_the_pause(tmp_path):
    cfg = LlamaConfig()
    root = f"memory://mod-{uuid.uuid4().hex}"
    cks = _publish_chain(root, canonical_checkpoint(cfg, seed=1), 3, tmp_path)
    mod = VllmLlama(cfg, 0, 2)
    first = receive_into_module(root, "r", mod, 0)
    assert first["mode"] == "dense"
    res = receive_into_module(root, "r", mod, 2)
    assert res["mode"] == "delta" and res["moves"] == ["forward:1", "forward:2"]
    assert res["direct"] > 0 and res["overwrite"] == 0
    assert 0 <= res["pause_seconds"] <= res["modify_wall_seconds"] + 1e-6
    assert_bits_equal(module_bits(mod), _dense(lambda: VllmLlama(cfg, 0, 2), cks[2]))


def test_a_module_changed_behind_dcrs_back_is_reloaded_densely(tmp_path):
    cfg = LlamaConfig()
    root = f"memory://mod-{uuid.uuid4().hex}"
    cks = _publish_chain(root, canonical_checkpoint(cfg, seed=2), 2, tmp_path)
    mod = VllmLlama(cfg)
    receive_into_module(root, "r", mod, 0)
    with torch.no_grad():
        next(mod.parameters()).view(-1)[0] += 1  # drift
    res = receive_into_module(root, "r", mod, 1)
    assert res["mode"] == "dense"
    assert_bits_equal(module_bits(mod), _dense(lambda: VllmLlama(cfg), cks[1]))


def test_the_probe_classifies_placing_quantizing_offsetting_and_rechunking_loaders(tmp_path):
    cfg = LlamaConfig()
    ck = canonical_checkpoint(cfg, seed=3)
    schema = [(n, {torch.bfloat16: "BF16", torch.float32: "F32"}[t.dtype], tuple(t.shape)) for n, t in ck.items()]
    vllm = placement.probe_module(VllmLlama(cfg, 1, 2), schema)
    assert vllm.names(placement.OVERWRITE) == [] and vllm.names(placement.IGNORED) == []
    fp8 = placement.probe_module(Fp8BlockQuantized.from_checkpoint(ck), schema)
    two_d = sorted(n for n, t in ck.items() if t.dim() == 2)
    assert fp8.names(placement.OVERWRITE) == two_d
    off = placement.probe_module(OffsetNorm.from_checkpoint(ck), schema)
    assert off.names(placement.OVERWRITE) == sorted(n for n in ck if "norm" in n and n.endswith(".weight"))
    experts = RechunkedExperts.checkpoint(0)
    rechunk = placement.probe_module(
        RechunkedExperts(), [(n, "BF16", tuple(t.shape)) for n, t in experts.items()]
    )
    assert rechunk.names(placement.DIRECT) == sorted(experts)
    tied_cfg = LlamaConfig(tie_word_embeddings=True)
    tied = placement.probe_module(VllmLlama(tied_cfg), schema)
    assert tied.names(placement.IGNORED) == ["lm_head.weight"]


@pytest.mark.parametrize("kind", ["fp8", "offset", "rechunk"])
def test_non_preserving_and_rechunking_loaders_refit_exactly(kind, tmp_path):
    root = f"memory://mod-{uuid.uuid4().hex}"
    if kind == "rechunk":
        first = RechunkedExperts.checkpoint(1)
        factory = RechunkedExperts
    else:
        first = canonical_checkpoint(LlamaConfig(), seed=4)
        cls = Fp8BlockQuantized if kind == "fp8" else OffsetNorm
        factory = lambda: cls.from_checkpoint(first)
    cks = _publish_chain(root, first, 4, tmp_path)
    mod = factory()
    for step in [0, 1, 3, 2, 3]:
        res = receive_into_module(root, "r", mod, step, state_path=str(tmp_path / "mirror.safetensors"))
        assert_bits_equal(module_bits(mod), _dense(factory, cks[step]))
    if kind != "rechunk":
        assert res["overwrite"] > 0 and res["direct"] > 0


def test_greedy_generation_after_a_dcr_refit_matches_a_dense_refit(tmp_path):
    root = f"memory://mod-{uuid.uuid4().hex}"
    first = hf_checkpoint(HFReceiver(seed=5))
    cks = _publish_chain(root, first, 3, tmp_path)
    live = HFReceiver(seed=6)
    for step in range(3):
        receive_into_module(root, "hf", live, step)
    dense = HFReceiver(seed=7)
    dense.load_weights(list(cks[2].items()))
    assert_bits_equal(module_bits(live), module_bits(dense))
    prompt = [1, 5, 9, 3]
    assert greedy_tokens(live, prompt, 8) == greedy_tokens(dense, prompt, 8)


@pytest.mark.faults(component="live module", outcome="the module is rolled back to its base bits; a retry refits it exactly")
@pytest.mark.parametrize(
    "kind,fail_at", [("direct", 1), ("direct", 3), ("direct", 7), ("overwrite", 1), ("overwrite", 2), ("overwrite", 3)]
)
def test_a_failure_mid_apply_rolls_the_live_module_back_to_its_base_bits(tmp_path, monkeypatch, kind, fail_at):
    """A slot write (direct path) or a loader call (overwrite path) fails part-way: the module
    returns to the exact bits of the step it held, and a retry takes the delta path to the target."""
    if kind == "direct":
        cfg = LlamaConfig()
        factory = lambda: VllmLlama(cfg, 0, 2)
        first = canonical_checkpoint(cfg, seed=4)
    else:
        first = canonical_checkpoint(LlamaConfig(), seed=4)
        factory = lambda: OffsetNorm.from_checkpoint(first)
    root = f"memory://mod-{uuid.uuid4().hex}"
    cks = _publish_chain(root, first, 3, tmp_path)
    mod = factory()
    receive_into_module(root, "r", mod, 0, state_path=str(tmp_path / "mirror.safetensors"))
    base = module_bits(mod)
    real_budget = placement.xor_into_module.__defaults__
    calls = fail_mid_apply(monkeypatch, kind, fail_at, type(mod), is_norm)  # overwrite path: norms reloaded
    with pytest.raises(RuntimeError):
        receive_into_module(root, "r", mod, 2, state_path=str(tmp_path / "mirror.safetensors"))
    assert calls["n"] >= fail_at
    assert_bits_equal(module_bits(mod), base)  # rolled back to step 0, bit for bit
    monkeypatch.undo()
    if kind == "direct":
        assert placement.xor_into_module.__defaults__ != (1,) and real_budget
    res = receive_into_module(root, "r", mod, 2, state_path=str(tmp_path / "mirror.safetensors"))
    assert res["mode"] == "delta"  # still known to hold step 0: no dense reload needed
    assert_bits_equal(module_bits(mod), _dense(factory, cks[2]))


def _rank_pulls(cfg, tp, column_blocks, tmp_path):
    """Publish a keyframe and one ~2% delta (``column_blocks``), load every rank densely at step 0,
    refit each to step 1 by delta: per rank, the bytes pulled and whether its bits equal a dense load."""
    root = f"memory://pull-{uuid.uuid4().hex}"
    first = canonical_checkpoint(cfg, seed=3)
    cks = [first, _evolve(first, 2)]
    opts = PublishOptions(chunk_bytes=2048, column_blocks=column_blocks, cache_dir=str(tmp_path / f"c{column_blocks}"))
    results = [run_publish(root, ck, s, options=opts) for s, ck in enumerate(cks)]
    pulls = []
    for r, mod in enumerate(tp_group(cfg, tp)):
        state = str(tmp_path / f"m{tp}-{column_blocks}-{r}.safetensors")
        assert receive_into_module(root, f"r{r}", mod, 0, state_path=state)["mode"] == "dense"
        res = receive_into_module(root, f"r{r}", mod, 1, state_path=state)
        assert res["mode"] == "delta"
        assert_bits_equal(module_bits(mod), _dense(lambda r=r: VllmLlama(cfg, r, tp), cks[1]))
        pulls.append(res["bytes_pulled"])
    return pulls, results[1].summary["bytes_stored"]


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_tensor_parallel_ranks_pull_only_the_chunks_their_own_loader_reads(tp, tmp_path):
    """Each rank's demand comes from its own loader (index-tagged probes), never from placement
    rules: with column blocks, column-parallel (qkv, gate/up, vocab rows) and row-parallel (o, down:
    column slices) weights both cost a rank about 1/TP of the step; replicated norms cost every rank."""
    cfg = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_heads=8, num_kv_heads=4)
    pulls, stored = _rank_pulls(cfg, tp, 4, tmp_path)
    per_rank = stored / tp
    assert all(p <= 1.2 * per_rank for p in pulls), (pulls, stored)  # chunk granularity: k/v rows, norms
    assert sum(pulls) >= stored  # every stored chunk is someone's (nothing silently skipped)
    if tp == 1:
        assert pulls == [stored]
    # contiguous chunks: row-parallel weights' column slices cross every chunk, so ranks pull more
    runs, stored_runs = _rank_pulls(cfg, tp, 1, tmp_path)
    if tp > 1:
        assert max(runs) > 1.25 * stored_runs / tp > max(pulls) * 1.1, (runs, pulls)


def test_the_demand_probe_finds_each_loaders_slice_and_falls_back_to_everything(monkeypatch):
    cfg = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_heads=8, num_kv_heads=4)
    mod = VllmLlama(cfg, 1, 4)
    schema = [(n, "BF16", tuple(t.shape)) for n, t in canonical_checkpoint(cfg, 0).items()]
    table = placement.probe_module(mod, schema)
    monkeypatch.setattr(placement, "PIECE", 37)  # the same demand when decoded in small pieces
    again = placement.probe_module(VllmLlama(cfg, 1, 4), schema)
    for name, p in table.probes.items():
        d, e = p.demand, again.probes[name].demand
        assert (d is None) == (e is None), name
        if d is not None:
            assert d.starts.tolist() == e.starts.tolist() and d.stops.tolist() == e.stops.tolist(), name
    o = table.probes["model.layers.0.self_attn.o_proj.weight"].demand  # row-parallel: columns 32..63 of 128
    assert o.elements == 128 * 32 and o.starts[:2].tolist() == [32, 160] and o.stops[0] == 64
    q = table.probes["model.layers.0.self_attn.q_proj.weight"].demand  # column-parallel: rows 32..63
    assert q.starts.tolist() == [32 * 128] and q.stops.tolist() == [64 * 128]
    norm = table.probes["model.norm.weight"].demand
    assert norm.starts.tolist() == [0] and norm.stops.tolist() == [128]
    # a permuting loader reads everything; one that moves bits within elements is not a copy of
    # elements: its demand cannot be told, so it is everything (None), and refits stay exact
    rec = placement.probe_module(RechunkedExperts(), [(f"experts.{e}.w1.weight", "BF16", (16, 8)) for e in range(4)])
    for p in rec.probes.values():
        assert p.path == placement.DIRECT and p.demand.elements == 16 * 8
    swapped = placement.probe_module(ByteSwapped(), [("w", "BF16", (6, 4))])
    assert swapped.probes["w"].path == placement.DIRECT and swapped.probes["w"].demand is None


class ByteSwapped(torch.nn.Module):
    """Pure bit placement that is not a copy of whole elements: each element's two bytes swapped."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(6, 4, dtype=torch.bfloat16), requires_grad=False)

    def load_weights(self, weights):
        for _, t in weights:
            self.w.data.view(torch.uint8).view(6, 4, 2).copy_(t.contiguous().view(torch.uint8).view(6, 4, 2).flip(-1))


def test_demand_runs_merge_overlaps_repeats_and_empty_pieces():
    d = placement.Demand.of(20, np.array([5, 6, 7, 3, 4, 6, 12, 12, 13, 19]))
    assert d.starts.tolist() == [3, 12, 19] and d.stops.tolist() == [8, 14, 20] and d.elements == 8
    empty = placement.Demand.merged(20, [np.zeros(0, np.int64)], [np.zeros(0, np.int64)])
    assert empty.elements == 0 and placement.Demand.merged(20, [], []).elements == 0
    grid = ChunkGrid((5, 4), (1, 4))  # rows of 4: row 2 (elements 8..11) holds none
    assert d.chunks(grid) == {0, 1, 3, 4}
    blocks = ChunkGrid((5, 4), (3, 2))  # column blocks: (rows 0-2 | 3-4) x (cols 0-1 | 2-3)
    assert d.chunks(blocks) == {0, 1, 2, 3}
    assert placement.Demand.of(20, np.array([8, 9, 16])).chunks(blocks) == {0, 2}
