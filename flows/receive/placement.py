"""Placing canonical tensors into a live module through its own ``load_weights``, bit for bit.

The receiver never reimplements placement rules. It learns, per canonical tensor, which of the
module's parameters and buffers (its *slots*) the loader writes, and whether the loader is a pure
placement of bits, by watching the loader work on scratch storage:

- *Which slots*: every slot is swapped for an uninitialised scratch tensor (virtual memory: pages
  are only touched where the loader writes) and ``load_weights([(name, probe)])`` runs under a
  dispatch mode that records every tensor an op mutates. Nothing live is touched.
- *Pure placement*: on zeroed scratch of those slots, loading random bits A, B and A^B must give
  scratch contents sA, sB, sAB with sA ^ sB == sAB, loading zeros must give zeros, and loading A
  twice must give the same bits. Copies, narrowing, concatenation, replication and any
  permutation (re-chunking) pass; casts, quantization and arithmetic (offsets) fail.

Tensors that pass take the direct path: their XOR mask is loaded into zeroed scratch of their
slots and the scratch is XORed into the live slots (unchanged regions receive zeros: no change).
Tensors that fail take the overwrite path: their new canonical values are loaded through the
loader, from a host-side copy of just those tensors. Tensors whose loader writes nothing (a tied
``lm_head.weight``, say) need nothing.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import blake3
import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dcr_core.bits import bits_of, tensor_from_bits
from dcr_core.dtypes import DTYPES
from dcr_core.errors import DCRError

DIRECT, OVERWRITE, IGNORED = "direct", "overwrite", "ignored"


class PlacementError(DCRError):
    """The module's loader did something the probe did not predict; nothing was applied."""

    exit_code = 5


@dataclass(frozen=True, slots=True)
class Slot:
    """One parameter or buffer of the module, by its owner and attribute name."""

    owner: torch.nn.Module
    attr: str
    is_param: bool
    qualname: str

    def get(self) -> torch.Tensor:
        if self.is_param:
            return self.owner._parameters[self.attr].data
        return self.owner._buffers[self.attr]

    def set(self, t: torch.Tensor) -> None:
        if self.is_param:
            self.owner._parameters[self.attr].data = t
        else:
            self.owner._buffers[self.attr] = t


def slots_of(module: torch.nn.Module) -> list[Slot]:
    """Every distinct parameter and buffer (tied parameters once), in a stable order."""
    seen: set[int] = set()
    out = []
    for mod_name, mod in module.named_modules():
        for kind, table in ((True, mod._parameters), (False, mod._buffers)):
            for attr, t in table.items():
                if t is None or id(t) in seen:
                    continue
                seen.add(id(t))
                out.append(Slot(mod, attr, kind, f"{mod_name}.{attr}" if mod_name else attr))
    return out


class _RecordWrites(TorchDispatchMode):
    """Records which slot storages any op mutates (by the schema's write-alias annotations)."""

    def __init__(self, ptrs: dict[int, int]):
        super().__init__()
        self.ptrs = ptrs
        self.written: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for i, a in enumerate(func._schema.arguments):
            if a.alias_info is None or not a.alias_info.is_write:
                continue
            v = args[i] if i < len(args) else kwargs.get(a.name)
            for t in v if isinstance(v, (list, tuple)) else (v,):
                if isinstance(t, torch.Tensor) and t.device.type != "meta":
                    slot = self.ptrs.get(t.untyped_storage().data_ptr())
                    if slot is not None:
                        self.written.add(slot)
        return func(*args, **kwargs)


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.numel() == 0 and b.numel() == 0:
        return a.shape == b.shape
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() and a.shape == b.shape


def _scratch_like(t: torch.Tensor, zero: bool) -> torch.Tensor:
    return torch.zeros_like(t) if zero else torch.empty_like(t)


def _run_on_scratch(
    module, slots: list[Slot], load: Iterable[tuple[str, torch.Tensor]], zeroed: set[int]
) -> tuple[set[int], dict[int, torch.Tensor]]:
    """Run ``module.load_weights(load)`` with every slot swapped for scratch; live slots untouched.

    Slots in ``zeroed`` get zero-filled scratch (their contents are returned); the others get
    uninitialised scratch. Returns the slots written and the zeroed scratch tensors.
    """
    live = [s.get() for s in slots]
    scratch = {i: _scratch_like(live[i], i in zeroed) for i in range(len(slots))}
    ptrs = {scratch[i].untyped_storage().data_ptr(): i for i in scratch if scratch[i].numel()}
    try:
        for i, s in enumerate(slots):
            s.set(scratch[i])
        with _RecordWrites(ptrs) as rec:
            module.load_weights(load)
        replaced = [i for i, s in enumerate(slots) if not _same_storage(s.get(), scratch[i])]
    finally:
        for i, s in enumerate(slots):
            s.set(live[i])
    if replaced:
        raise PlacementError(
            f"load_weights replaced slot {slots[replaced[0]].qualname} instead of writing into it"
        )
    return rec.written, {i: scratch[i] for i in zeroed}


def _random_like(dtype: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    dt = DTYPES[dtype]
    rng = np.random.default_rng(seed)
    bits = rng.integers(0, 2**dt.bits, size=math.prod(shape), dtype=np.uint64).astype(dt.storage)
    if dtype == "BOOL":
        bits &= 1  # a bool holds 0 or 1
    return tensor_from_bits(bits, dt, shape)


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and bool(np.array_equal(bits_of(a), bits_of(b)))


@dataclass(frozen=True)
class Probe:
    """How one canonical tensor reaches the module: its path and the slots its loader writes."""

    path: str
    slots: tuple[int, ...] = ()
    reason: str = ""


@dataclass
class ProbeTable:
    """Per-receiver probe results, keyed by canonical name, for one (name, dtype, shape) schema."""

    schema: tuple
    probes: dict[str, Probe] = field(default_factory=dict)

    def names(self, path: str) -> list[str]:
        return sorted(n for n, p in self.probes.items() if p.path == path)


def probe_tensor(module, slots: list[Slot], name: str, dtype: str, shape: tuple[int, ...]) -> Probe:
    """Classify one canonical tensor's loader (see module docstring). Live slots are untouched."""
    a = _random_like(dtype, shape, seed=1)
    b = _random_like(dtype, shape, seed=2)
    ab = tensor_from_bits(bits_of(a) ^ bits_of(b), DTYPES[dtype], shape)
    zero = tensor_from_bits(np.zeros(math.prod(shape), dtype=DTYPES[dtype].storage), DTYPES[dtype], shape)
    written, _ = _run_on_scratch(module, slots, [(name, a)], set())
    if not written:
        return Probe(IGNORED, (), "the loader writes nothing for it")
    target = set(written)
    results = {}
    for key, value in (("a", a), ("b", b), ("ab", ab), ("zero", zero), ("a2", a)):
        w, scratch = _run_on_scratch(module, slots, [(name, value)], target)
        if not w <= target:
            return Probe(OVERWRITE, tuple(sorted(target)), "writes depend on the values")
        results[key] = scratch
    for i in target:
        sa, sb, sab = (bits_of(results[k][i]) for k in ("a", "b", "ab"))
        if not np.array_equal(sa ^ sb, sab):
            return Probe(OVERWRITE, tuple(sorted(target)), "loaded values do not XOR consistently")
        if np.count_nonzero(bits_of(results["zero"][i])):
            return Probe(OVERWRITE, tuple(sorted(target)), "zero does not load as zero")
        if not _bits_equal(results["a"][i], results["a2"][i]):
            return Probe(OVERWRITE, tuple(sorted(target)), "loading is not deterministic")
    return Probe(DIRECT, tuple(sorted(target)))


def probe_module(module, schema: Iterable[tuple[str, str, tuple[int, ...]]]) -> ProbeTable:
    """Probe every canonical tensor of ``schema`` ((name, dtype, shape) triples)."""
    schema = tuple(sorted((n, d, tuple(s)) for n, d, s in schema))
    slots = slots_of(module)
    table = ProbeTable(schema)
    for name, dtype, shape in schema:
        table.probes[name] = probe_tensor(module, slots, name, dtype, shape)
    return table


def xor_into_module(
    module, table: ProbeTable, masks: Iterable[tuple[str, torch.Tensor]], budget_bytes: int = 256 << 20
) -> float:
    """Apply XOR masks of direct-path tensors to the live module; returns seconds spent modifying it.

    Masks are placed by the module's own loader into zeroed scratch (bucketed so that scratch stays
    under ``budget_bytes`` unless one tensor alone needs more), then XORed into the live slots.
    All or nothing: if anything fails (a slot write, or the loader on a later bucket), every slot
    already modified is XORed again with the same mask, which restores its bits exactly (XOR is its
    own inverse), and the error is raised. Only if that undo itself fails is the module left
    changed, with a ``PlacementError`` saying so (the next refit then reloads it densely).
    """
    masks = list(masks)
    applied: list[tuple[str, torch.Tensor]] = []
    try:
        return _xor_buckets(module, table, masks, budget_bytes, applied)
    except BaseException as e:  # undo on any exit (an interrupt too), then re-raise
        if applied:
            try:
                _xor_buckets(module, table, applied, budget_bytes, [])
            except BaseException as undo:  # noqa: BLE001 - reported with the original error
                raise PlacementError(
                    f"applying masks failed ({type(e).__name__}: {e}) and undoing them failed too "
                    f"({type(undo).__name__}: {undo}); the module must be reloaded"
                ) from e
        raise


def _xor_buckets(module, table: ProbeTable, masks, budget_bytes: int, applied: list) -> float:
    """XOR ``masks`` into the module bucket by bucket; each fully applied bucket's masks are
    appended to ``applied`` (a failing bucket undoes its own slots before raising)."""
    slots = slots_of(module)
    live_bytes = {i: s.get().numel() * s.get().element_size() for i, s in enumerate(slots)}
    modifying = 0.0
    bucket: list[tuple[str, torch.Tensor]] = []
    bucket_slots: set[int] = set()

    def flush() -> float:
        if not bucket:
            return 0.0
        written, scratch = _run_on_scratch(module, slots, list(bucket), set(bucket_slots))
        if not written <= bucket_slots:
            extra = sorted(written - bucket_slots)
            raise PlacementError(f"the loader wrote {slots[extra[0]].qualname}, which the probe did not predict")
        t0 = time.perf_counter()
        done: list[int] = []
        try:
            for i in sorted(bucket_slots):
                _xor_slot(slots[i], scratch[i])
                done.append(i)
        except BaseException:
            for i in done:  # roll back: XOR is its own inverse
                _xor_slot(slots[i], scratch[i])
            raise
        applied.extend(bucket)
        bucket.clear()
        bucket_slots.clear()
        return time.perf_counter() - t0

    for name, mask in masks:
        probe = table.probes[name]
        if probe.path != DIRECT:
            raise PlacementError(f"tensor {name!r} is not on the direct path ({probe.path})")
        need = set(probe.slots) - bucket_slots
        if bucket and sum(live_bytes[i] for i in bucket_slots | need) > budget_bytes:
            modifying += flush()
        bucket.append((name, mask))
        bucket_slots.update(probe.slots)
    modifying += flush()
    return modifying


def _xor_slot(slot: Slot, scratch: torch.Tensor) -> None:
    live = slot.get()
    if live.device.type == "cpu" and live.is_contiguous():
        view = bits_of(live)  # shares memory with the live slot
        np.bitwise_xor(view, bits_of(scratch), out=view)
        return
    host = live.detach().cpu().contiguous().clone()
    b = bits_of(host)
    np.bitwise_xor(b, bits_of(scratch), out=b)
    live.copy_(host.to(live.device))


def fingerprint(module) -> str:
    """BLAKE3 over the bits of every slot, in order: detects any change made outside DCR."""
    h = blake3.blake3()
    for s in slots_of(module):
        t = s.get().detach()
        h.update(s.qualname.encode() + b"\0" + str(t.dtype).encode() + b"\0" + str(tuple(t.shape)).encode())
        h.update(memoryview(bits_of(t)).cast("B"))
    return h.hexdigest()
