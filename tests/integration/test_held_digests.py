"""What a live target holds (``flows.receive.held_digests``), checked the same way for a torch module
as for a vLLM engine: every module hashed before a refit, so a module changed behind DCR's back by
any path (``.data``, a numpy view, an in-place op, a new tensor) is reloaded densely; the modules a
delta writes hashed again right before it writes them and after, for the record."""

from __future__ import annotations

import uuid
from collections import Counter

import pytest
import torch

from dcr_bench.models.llama_vllm import LlamaConfig, VllmLlama, canonical_checkpoint
from dcr_core.errors import StateMismatchError
from flows import receive_into_module, run_publish
from flows.options import PublishOptions
from flows.receive import held_digests, module, placement
from flows.receive.module_pipeline import ModuleSteps
from tests.support.helpers import assert_bits_equal, module_bits
from tests.support.steps import patch_step


def _dense(cfg, ck):
    m = VllmLlama(cfg)
    m.load_weights(list(ck.items()))
    return module_bits(m)


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


def _counting(monkeypatch) -> Counter:
    """Module name -> times hashed (modules that hold something)."""
    hashed: Counter = Counter()
    real = held_digests.module_digest

    def counted(name, mod):
        d = real(name, mod)
        if d is not None:
            hashed[name] += 1
        return d

    monkeypatch.setattr(held_digests, "module_digest", counted)
    return hashed


def _written(mod, name: str) -> set[str]:
    slots = placement.slots_of(mod)
    return held_digests.holders(mod, [slots[i].get() for i in mod._dcr_probe.probes[name].slots])


def test_a_delta_checks_every_module_once_and_hashes_again_only_those_it_writes(two_steps, monkeypatch):
    cfg, root, cks, name = two_steps
    mod = VllmLlama(cfg)
    holding = set(held_digests.digests_of(mod))
    hashed = _counting(monkeypatch)
    assert receive_into_module(root, "r", mod, 0)["mode"] == "dense"
    assert hashed == Counter(dict.fromkeys(holding, 1)), "a dense load hashes every module once"
    hashed.clear()
    res = receive_into_module(root, "r", mod, 1)
    assert res["mode"] == "delta" and "modules_written" not in res
    written = _written(mod, name)
    assert 0 < len(written) < len(holding) / 4
    # the check before the refit, the check right before the write, the record after it
    assert hashed == Counter({n: 3 if n in written else 1 for n in holding})
    assert_bits_equal(module_bits(mod), _dense(cfg, cks[1]))
    assert module.held_by(mod)["fingerprint"] == held_digests.fingerprint(mod), "kept digests are exact"
    hashed.clear()
    assert receive_into_module(root, "r", mod, 1)["mode"] == "current"
    assert hashed == Counter(dict.fromkeys(holding, 1)), "a receive with nothing to apply checks, records nothing"
    assert receive_into_module(root, "r", mod, 0)["mode"] == "delta"
    assert_bits_equal(module_bits(mod), _dense(cfg, cks[0]))


@pytest.mark.faults(component="live module receiver", outcome="a module rewritten behind DCR's back through .data or a numpy view (no version bump, one element or all), an in-place op or a new tensor: the digests of every module, taken before the refit, see it; the refit loads densely, bit-exact")
@pytest.mark.parametrize("how", ["data-copy-whole", "data-one-element", "data-last-element-of-the-largest",
                                 "numpy-view", "in-place-op", "replaced", "buffer"])
def test_a_module_changed_behind_dcrs_back_is_reloaded_densely(two_steps, how):
    cfg, root, cks, name = two_steps
    mod = VllmLlama(cfg)
    receive_into_module(root, "r", mod, 0)
    p = next(p for n, p in mod.named_parameters() if p.dim() == 2)
    if how == "data-copy-whole":
        p.data.copy_(torch.randn_like(p))  # a vLLM-style load of other weights: no version bump
    elif how == "data-one-element":
        p.data.view(-1)[5] = 3.0
    elif how == "data-last-element-of-the-largest":  # a sampled block per tensor would miss it
        max(mod.parameters(), key=lambda t: t.numel()).data.view(-1)[-1] = 7.0
    elif how == "numpy-view":
        p.detach().view(torch.int16).numpy().reshape(-1)[9] ^= 1
    elif how == "in-place-op":
        with torch.no_grad():
            p.mul_(1.5)
    elif how == "replaced":
        p.data = p.data.clone() + 1
    else:
        next(mod.buffers()).data.view(-1)[0] += 1
    res = receive_into_module(root, "r", mod, 1)
    assert res["mode"] == "dense", how
    assert_bits_equal(module_bits(mod), _dense(cfg, cks[1]))


@pytest.mark.faults(component="live module receiver", outcome="a module the delta writes, rewritten while the step is fetched: the check right before the write sees it, nothing is applied (StateMismatchError), the module unknown; the next receive loads densely, bit-exact")
def test_a_write_while_the_step_is_fetched_stops_the_delta_before_anything_changes(two_steps, monkeypatch):
    cfg, root, cks, name = two_steps
    mod = VllmLlama(cfg)
    receive_into_module(root, "r", mod, 0)
    slot = placement.slots_of(mod)[mod._dcr_probe.probes[name].slots[0]]
    seen = {}

    def fetch_then_write(real, *args, **kwargs):
        fetched = real(*args, **kwargs)
        slot.get().view(-1)[3] = 5.0  # through .data: no version bump
        seen.update(module_bits(mod))
        return fetched

    patch_step(monkeypatch, ModuleSteps, "fetch_module_payloads", fetch_then_write)
    with pytest.raises(StateMismatchError, match="nothing was applied"):
        receive_into_module(root, "r", mod, 1)
    assert_bits_equal(module_bits(mod), seen)
    assert module.held_by(mod) is None
    monkeypatch.undo()
    assert receive_into_module(root, "r", mod, 1)["mode"] == "dense"
    assert_bits_equal(module_bits(mod), _dense(cfg, cks[1]))


def test_a_module_the_delta_does_not_write_rewritten_meanwhile_is_found_by_the_next_receive(two_steps, monkeypatch):
    cfg, root, cks, name = two_steps
    mod = VllmLlama(cfg)
    receive_into_module(root, "r", mod, 0)
    written = _written(mod, name)
    other = next(m for n, m in mod.named_modules() if n not in written and m._parameters.get("weight") is not None)

    def fetch_then_write(real, *args, **kwargs):
        fetched = real(*args, **kwargs)
        other.weight.data.view(-1)[0] += 1
        return fetched

    patch_step(monkeypatch, ModuleSteps, "fetch_module_payloads", fetch_then_write)
    assert receive_into_module(root, "r", mod, 1)["mode"] == "delta"  # nothing was applied onto the edit
    monkeypatch.undo()
    assert receive_into_module(root, "r", mod, 1)["mode"] == "dense"
    assert_bits_equal(module_bits(mod), _dense(cfg, cks[1]))


def test_tensors_off_the_cpu_or_not_contiguous_hash_through_bounded_copies_as_their_bytes(monkeypatch):
    t = torch.arange(6000, dtype=torch.float32).reshape(60, 100)
    a, b = torch.nn.Linear(60, 100, bias=False), torch.nn.Linear(60, 100, bias=False)
    a.weight.data, b.weight.data = t.t(), t.t().contiguous()  # the same values, one not contiguous
    monkeypatch.setattr(held_digests, "HOST_CHUNK_BYTES", 4096)  # 6 copies of 4 KiB for 24000 bytes
    assert not a.weight.is_contiguous() and held_digests.module_digest("x", a) == held_digests.module_digest("x", b)
    b.weight.data.view(-1)[-1] += 1
    assert held_digests.module_digest("x", a) != held_digests.module_digest("x", b)


def test_a_write_to_a_tied_tensor_changes_every_module_that_holds_it():
    emb, head = torch.nn.Embedding(8, 4), torch.nn.Linear(4, 8, bias=False)
    head.weight = emb.weight
    model = torch.nn.ModuleDict({"emb": emb, "head": head, "other": torch.nn.Linear(4, 4)})
    assert held_digests.holders(model, [emb.weight.data]) == {"emb", "head"}
    held = held_digests.digests_of(model)
    emb.weight.data[0, 0] += 1
    assert not held_digests.unchanged(model, held, {"emb"}) and not held_digests.unchanged(model, held, {"head"})
    assert held_digests.unchanged(model, held, {"other"})
    assert held_digests.after(model, held, {"emb", "head"}) == held_digests.digests_of(model)


def test_one_element_anywhere_in_a_large_tensor_is_seen_though_no_version_counter_moves():
    """4 MiB in one tensor: a check by stamps and a sampled block per tensor would miss most of these."""
    model = torch.nn.Sequential(torch.nn.Linear(2048, 1024, bias=False)).to(torch.bfloat16)
    w = model[0].weight
    held, version = held_digests.digests_of(model), w._version
    for at in (0, w.numel() // 2, w.numel() - 1):
        w.data.view(-1).view(torch.int16)[at] ^= 1
        assert w._version == version and not held_digests.unchanged(model, held), at
        w.data.view(-1).view(torch.int16)[at] ^= 1
        assert held_digests.unchanged(model, held)


class _SlottedKernel:
    """A kernel callable that takes no weak reference (``__slots__``, no ``__weakref__``)."""

    __slots__ = ("w",)

    def __init__(self, w):
        self.w = w

    def __call__(self, x, weight, bias):
        return torch.nn.functional.linear(x, self.w, bias)


@pytest.mark.parametrize("kernel", ["lambda", "no weak reference"])
def test_a_pending_digest_is_the_modules_digest_while_its_kernel_stays_and_never_once_replaced(kernel):
    lin = torch.nn.Linear(8, 4, bias=True).to(torch.bfloat16)
    packed = lin.weight.detach().clone()
    lin.input_size_per_partition, lin.params_dtype = 8, torch.bfloat16

    def build(w):
        return (lambda x, weight, bias: torch.nn.functional.linear(x, w, bias)) if kernel == "lambda" else _SlottedKernel(w)

    lin.cpu_linear = build(packed.clone())
    model = torch.nn.Sequential(lin)
    whole = held_digests.digests_of(model)
    kernels = held_digests.kernels_of(model)
    assert set(kernels) == {"0"}
    part = held_digests.digests_of(model, kernels=kernels)
    assert held_digests.pending(part) and not held_digests.pending(whole)
    with pytest.raises(ValueError, match="not read yet"):
        held_digests.combine(part)
    assert held_digests.resolve(model, part) == whole
    assert held_digests.resolve(model, part, held_digests.probes_of(model)) == whole
    lin.cpu_linear = build(packed.clone())  # the same weights, another kernel: not the one recorded
    assert held_digests.resolve(model, part) == {"0": held_digests.KERNEL_REPLACED}
    with pytest.raises(KeyError, match="not read in the engine's thread"):
        held_digests.digests_of(model, kernels={})
