"""Live modules refit bundled steps (manifest schema 4) exactly: a bundle's members are placed by
name through the module's own loader, and every parameter and buffer ends byte for byte as a dense
load of the checkpoint leaves it, forward, backward, from nothing and after a rolled-back failure."""

from __future__ import annotations

import json
import struct
import uuid

import pytest
import torch

from dcr_bench.models.llama_vllm import LlamaConfig, VllmLlama, canonical_checkpoint
from dcr_core.errors import StateMismatchError
from flows import receive_into_module, run_publish
from flows.options import PublishOptions
from flows.receive import held_digests, module, placement
from storage import reader
from storage.root import open_root
from tests.integration.test_module_refit import _dense, _evolve
from tests.support.helpers import assert_bits_equal, module_bits, nasty_checkpoint, next_step
from tests.support.module_faults import fail_mid_apply
from tests.support.receivers.quantized import OffsetNorm, is_norm

DTYPES = ["BOOL", "U8", "I8", "F8_E4M3", "F8_E5M2", "I16", "U16", "F16", "BF16", "I32", "U32", "F32", "I64",
          "U64", "F64", "C64"]


class Nasty(torch.nn.Module):
    """Every tensor of a checkpoint held by name (0-d and empty ones too), parameters and buffers
    alternating: most copied in bit for bit (a placement: the direct path), the float ones named
    in ``inverted`` stored with every bit inverted (zeros do not load as zeros: the overwrite path)."""

    def __init__(self, ck: dict[str, torch.Tensor], inverted=()):
        super().__init__()
        self.slot_of = {n: f"t{i}" for i, n in enumerate(sorted(ck))}
        self.inverted = set(inverted)
        for i, (n, t) in enumerate(sorted(ck.items())):
            if i % 2:
                self.register_parameter(self.slot_of[n], torch.nn.Parameter(torch.zeros_like(t), requires_grad=False))
            else:
                self.register_buffer(self.slot_of[n], torch.zeros_like(t))

    def load_weights(self, weights):
        for n, t in weights:
            slot = getattr(self, self.slot_of[n])
            if (slot.dtype, slot.shape) != (t.dtype, t.shape):
                raise ValueError(f"{n}: {t.dtype}{tuple(t.shape)} does not fit {slot.dtype}{tuple(slot.shape)}")
            src = t.contiguous().reshape(-1).view(torch.uint8)
            dst = slot.data.reshape(-1).view(torch.uint8)
            dst.copy_(~src if n in self.inverted else src)


def _inverted(ck) -> list[str]:
    """Every second float tensor (of two dtypes) with elements, and ``F32.mat`` (stored alone):
    loaded through the overwrite path."""
    floats = sorted(n for n, t in ck.items() if t.dtype in (torch.float32, torch.bfloat16) and t.numel())
    return sorted(set(floats[::2]) | {"F32.mat"})


def _nasty_chain(root, tmp_path, steps=4, **opts):
    """A nasty chain (every dtype, NaNs of distinct payloads, +-0.0 flips, infinities, subnormals,
    0-d and empty tensors), bundled: chunks of 256 bytes, so a bundle spans many chunks and a chunk
    many members; tensors of 512 bytes and more stored alone."""
    cks = [nasty_checkpoint(seed=31, dtypes=DTYPES, big=30)]
    for s in range(1, steps):
        cks.append(next_step(cks[-1], seed=40 + s, fraction=0.2))
    o = PublishOptions(chunk_bytes=256, bundle_min_tensors=2, bundle_below=512, cache_dir=str(tmp_path / "pub"), **opts)
    for s, ck in enumerate(cks):
        run_publish(root, ck, s, options=o)
    return cks


def _manifest(root, step):
    r = open_root(root)
    plan = reader.plan_refit(r, None, step)
    return reader.manifests(plan, r)[step]


def test_a_bundled_chain_refits_a_live_module_exactly_forward_backward_and_from_nothing(tmp_path):
    root = f"memory://mb-{uuid.uuid4().hex}"
    cks = _nasty_chain(root, tmp_path)
    m = _manifest(root, 3)
    alone = [n for n, e in m.tensors.items() if e.members is None]
    assert m.schema_version == 4 and len(m.bundles()) >= 10 and "F32.mat" in alone and "C64.cube" in alone
    inverted = _inverted(cks[0])
    factory = lambda: Nasty(cks[0], inverted)
    mod = factory()
    mirror = str(tmp_path / "mirror.safetensors")
    modes = []
    for step in [0, 1, 3, 2, 0, 3, 3, 1]:
        res = receive_into_module(root, "r", mod, step, state_path=mirror)
        modes.append(res["mode"])
        assert res["step"] == step
        assert_bits_equal(module_bits(mod), _dense(factory, cks[step]))
        assert module.held_by(mod)["fingerprint"] == held_digests.fingerprint(mod)  # members tracked exactly
    assert modes[1] == modes[2] == "delta" and "current" in modes
    table = mod._dcr_probe
    members = {n for b in m.bundles().values() for n in b.names}
    assert set(table.probes) == set(cks[0]) and not any(n.startswith("%bundle.") for n in table.probes)
    assert members & set(table.names(placement.OVERWRITE)) and members & set(table.names(placement.DIRECT))
    fresh = factory()
    res = receive_into_module(root, "f", fresh, state_path=str(tmp_path / "fresh.safetensors"))
    assert res["mode"] == "dense" and res["tensors_loaded"] == len(cks[3])
    assert_bits_equal(module_bits(fresh), _dense(factory, cks[3]))
    res = receive_into_module(root, "f", fresh, 1, state_path=str(tmp_path / "fresh.safetensors"))
    assert res["mode"] == "delta" and res["moves"] == ["backward:3", "backward:2"]
    assert_bits_equal(module_bits(fresh), _dense(factory, cks[1]))


@pytest.mark.faults(component="live module", outcome="a bundled refit is rolled back to the base bits; a retry refits it exactly")
@pytest.mark.parametrize("kind,fail_at", [("direct", 1), ("direct", 9), ("overwrite", 1), ("overwrite", 3)])
def test_a_failure_mid_apply_of_a_bundled_step_rolls_the_module_back(tmp_path, monkeypatch, kind, fail_at):
    """A slot write (direct path) or a loader call (overwrite path) fails part-way through a
    bundled step: the module returns to the exact bits of the step it held, still known to hold it,
    and a retry takes the delta path to the target."""
    root = f"memory://mb-{uuid.uuid4().hex}"
    cks = _nasty_chain(root, tmp_path, steps=3)
    inverted = _inverted(cks[0])
    factory = lambda: Nasty(cks[0], inverted)
    mod = factory()
    mirror = str(tmp_path / "mirror.safetensors")
    receive_into_module(root, "r", mod, 0, state_path=mirror)
    base = module_bits(mod)
    calls = fail_mid_apply(monkeypatch, kind, fail_at, Nasty, lambda n: n in inverted)
    with pytest.raises(RuntimeError):
        receive_into_module(root, "r", mod, 2, state_path=mirror)
    assert calls["n"] >= fail_at
    assert_bits_equal(module_bits(mod), base)  # rolled back to step 0, bit for bit
    monkeypatch.undo()
    res = receive_into_module(root, "r", mod, 2, state_path=mirror)
    assert res["mode"] == "delta" and res["overwrite"] > 0 and res["direct"] > 0
    assert_bits_equal(module_bits(mod), _dense(factory, cks[2]))


def _flip_member_byte(path: str, name: str) -> None:
    """Flip the first byte of tensor ``name`` in a safetensors file."""
    with open(path, "r+b") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        at = 8 + n + json.loads(f.read(n))[name]["data_offsets"][0]
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x40]))


def test_a_bundle_whose_mirrored_member_is_wrong_is_refused_before_the_module_changes(tmp_path):
    """The partial mirror's bits of one member are damaged: the bundle does not reach the target's
    digests, nothing is applied, and the module keeps its bits."""
    root = f"memory://mb-{uuid.uuid4().hex}"
    cks = _nasty_chain(root, tmp_path, steps=2)
    factory = lambda: Nasty(cks[0])
    mod = factory()
    mirror = str(tmp_path / "mirror.safetensors")
    receive_into_module(root, "r", mod, 0, state_path=mirror)
    base = module_bits(mod)
    m = _manifest(root, 1)
    bundle, members = next((b, ms) for b, ms in m.bundles().items() if ms.dtype == "F32")
    victim = next(n for n, s in zip(members.names, members.shapes) if s and all(s))
    _flip_member_byte(mirror, victim)
    with pytest.raises(StateMismatchError) as e:
        receive_into_module(root, "r", mod, 1, state_path=mirror)
    assert bundle in str(e.value) and "\n" not in str(e.value)
    assert_bits_equal(module_bits(mod), base)


def _llama_chain(root, first, tmp_path, steps):
    cks = [first]
    for s in range(1, steps):
        cks.append(_evolve(cks[-1], s))
    opts = PublishOptions(chunk_bytes=256, bundle_min_tensors=2, bundle_below=8192, cache_dir=str(tmp_path / "pub"))
    for s, ck in enumerate(cks):
        run_publish(root, ck, s, options=opts)
    return cks


@pytest.mark.parametrize("kind", ["tp2", "offset"])
def test_tp_ranks_and_overwrite_loaders_refit_a_bundled_llama_exactly(kind, tmp_path):
    """vLLM-style tensor-parallel ranks (fused, sharded placements: each member's mask slice goes
    through the rank's own loader; bundles are fetched whole) and a loader that is not a placement
    (norms offset: members reloaded from the bundle's checked bits) end as a dense load."""
    cfg = LlamaConfig(num_kv_heads=2)
    root = f"memory://mb-{uuid.uuid4().hex}"
    first = canonical_checkpoint(cfg, seed=7)
    cks = _llama_chain(root, first, tmp_path, 4)
    m = _manifest(root, 3)
    assert m.bundles() and any(e.members is None for e in m.tensors.values())
    if kind == "tp2":
        factories = [lambda r=r: VllmLlama(cfg, r, 2) for r in range(2)]
    else:
        factories = [lambda: OffsetNorm.from_checkpoint(first)]
    mods = [f() for f in factories]
    for step in [0, 2, 3, 1, 3]:
        for r, (mod, factory) in enumerate(zip(mods, factories)):
            res = receive_into_module(root, f"r{r}", mod, step, state_path=str(tmp_path / f"m{r}.safetensors"))
            assert_bits_equal(module_bits(mod), _dense(factory, cks[step]))
    assert res["mode"] == "delta"
    if kind == "offset":
        over = set(mods[0]._dcr_probe.names(placement.OVERWRITE))
        assert over and all(is_norm(n) for n in over)
        assert over & {n for b in m.bundles().values() for n in b.names}
