"""Live modules: the slot digests a receiver keeps (``flows.receive.module_digests``): a delta
re-hashes only the slots it wrote, an idle receive none, and a module changed behind DCR's back,
also through paths that bypass torch's version counter, is reloaded densely, bit-exact."""

from __future__ import annotations

import uuid

import pytest
import torch

from dcr_bench.models.llama_vllm import LlamaConfig, VllmLlama, canonical_checkpoint
from flows import receive_into_module, run_publish
from flows.options import PublishOptions
from flows.receive import module, module_digests, placement
from tests.support.helpers import assert_bits_equal


def _bits(m: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {f"p:{n}": p.detach().clone() for n, p in m.named_parameters()}
    out.update({f"b:{n}": b.detach().clone() for n, b in m.named_buffers()})
    return out


def _dense(cfg, ck):
    m = VllmLlama(cfg)
    m.load_weights(list(ck.items()))
    return _bits(m)


@pytest.fixture()
def two_steps(tmp_path):
    """Step 0, and step 1 changing one weight only (bits flipped, a NaN payload, a zero's sign)."""
    cfg = LlamaConfig()
    ck0 = canonical_checkpoint(cfg, seed=4)
    name = sorted(n for n, t in ck0.items() if t.dtype == torch.bfloat16 and t.dim() == 2 and "proj" in n)[0]
    ck1 = {n: t.clone() for n, t in ck0.items()}
    bits = ck1[name].view(-1).view(torch.int16)
    bits[::7] ^= 3
    bits[1] = 0x7FC3
    bits[2] = -0x8000
    root = f"memory://digests-{uuid.uuid4().hex}"
    opts = PublishOptions(chunk_bytes=2048, cache_dir=str(tmp_path / "cache"))
    for s, ck in enumerate((ck0, ck1)):
        run_publish(root, ck, s, options=opts)
    return cfg, root, (ck0, ck1), name


def _counting(monkeypatch) -> list[int]:
    hashed: list[int] = []
    real = module_digests._leaves
    monkeypatch.setattr(module_digests, "_leaves", lambda t: hashed.append(t.data_ptr()) or real(t))
    return hashed


def test_a_delta_hashes_only_the_slots_it_wrote_and_an_idle_receive_none(two_steps, monkeypatch):
    cfg, root, cks, name = two_steps
    hashed = _counting(monkeypatch)
    mod = VllmLlama(cfg)
    assert receive_into_module(root, "r", mod, 0)["mode"] == "dense"
    slots = placement.slots_of(mod)
    assert sorted(hashed) == sorted(s.get().data_ptr() for s in slots), "a dense load hashes every slot"
    hashed.clear()
    res = receive_into_module(root, "r", mod, 1)
    assert res["mode"] == "delta" and "slots_written" not in res
    wrote = {slots[i].get().data_ptr() for i in mod._dcr_probe.probes[name].slots}
    assert set(hashed) == wrote and 0 < len(wrote) < len(slots) / 4
    assert_bits_equal(_bits(mod), _dense(cfg, cks[1]))
    held = module.held_by(mod)
    assert held["fingerprint"] == module_digests.fingerprint(module_digests.record(mod)), "kept digests are exact"
    hashed.clear()
    assert receive_into_module(root, "r", mod, 1)["mode"] == "current" and hashed == []
    assert receive_into_module(root, "r", mod, 0)["mode"] == "delta"
    assert_bits_equal(_bits(mod), _dense(cfg, cks[0]))


@pytest.mark.faults(component="live module receiver", outcome="a module rewritten behind DCR's back through .data (no version bump) or an in-place op: the sampled blocks or the stamps see it, the refit loads densely, bit-exact")
@pytest.mark.parametrize("how", ["data-copy-whole", "data-one-element", "in-place-op", "replaced"])
def test_a_module_changed_behind_dcrs_back_is_reloaded_densely(two_steps, how):
    cfg, root, cks, name = two_steps
    mod = VllmLlama(cfg)
    receive_into_module(root, "r", mod, 0)
    p = next(p for n, p in mod.named_parameters() if p.dim() == 2)
    if how == "data-copy-whole":
        p.data.copy_(torch.randn_like(p))  # a vLLM-style load of other weights: no version bump
    elif how == "data-one-element":
        p.data.view(-1)[5] = 3.0
    elif how == "in-place-op":
        with torch.no_grad():
            p.mul_(1.5)
    else:
        p.data = p.data.clone() + 1
    res = receive_into_module(root, "r", mod, 1)
    assert res["mode"] == "dense", how
    assert_bits_equal(_bits(mod), _dense(cfg, cks[1]))


def test_what_sampling_misses_a_full_check_finds(two_steps, monkeypatch):
    """The stated limit: an edit of one block of a multi-block slot that bypasses the version
    counter is found by a sampled block only with probability 1/blocks; ``full=True`` always."""
    cfg, root, cks, name = two_steps
    monkeypatch.setattr(module_digests, "BLOCK_BYTES", 4096)
    mod = VllmLlama(cfg)
    receive_into_module(root, "r", mod, 0)
    digests = module.held_by(mod)["slots"]
    p = max(mod.parameters(), key=lambda t: t.numel())
    assert p.numel() * p.element_size() > 4 * 4096
    p.data.view(-1)[-1] = 7.0
    monkeypatch.setattr(module_digests, "SAMPLED_BLOCKS_PER_SLOT", 0)
    assert module_digests.still_holds(mod, digests), "no sample, no version bump: not seen"
    assert not module_digests.still_holds(mod, digests, full=True)
    monkeypatch.setattr(module_digests, "SAMPLED_BLOCKS_PER_SLOT", 10**6)
    assert not module_digests.still_holds(mod, digests), "every block sampled: seen"
