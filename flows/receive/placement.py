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

*Demand* (direct-path tensors): which canonical elements the loader reads at all. Index-tagged
probes load each element's flat index (a few bits per load, a marker bit above them) into zeroed
scratch; the scratch then says, for every slot element written, which canonical element it came
from. That map must reproduce the random probes' scratch exactly (else the loader is not a copy
of elements and the demand is everything). Elements no slot comes from never reach the module, so
a tensor-parallel rank fetches only the chunks holding its own elements: masks of the others stay
zero, and zeros are what the loader would have placed nowhere anyway.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

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


@dataclass(frozen=True, eq=False)
class Demand:
    """The canonical elements a loader reads: sorted disjoint flat runs ``[starts[i], stops[i])``."""

    numel: int
    starts: np.ndarray
    stops: np.ndarray
    _chunks: dict = field(default_factory=dict, repr=False)

    @classmethod
    def of(cls, numel: int, indices: np.ndarray) -> Demand:
        """The elements ``indices`` (any order, repeats allowed): runs of consecutive indices as they
        come (a loader copying slices gives few), then merged (no sort of the indices themselves)."""
        if not indices.size:
            return cls(numel, np.zeros(0, np.int64), np.zeros(0, np.int64))
        breaks = np.flatnonzero(np.diff(indices) != 1) + 1
        starts = indices[np.r_[0, breaks]].astype(np.int64)
        stops = indices[np.r_[breaks - 1, indices.size - 1]].astype(np.int64) + 1
        return cls.merged(numel, [starts], [stops])

    @classmethod
    def merged(cls, numel: int, starts: list[np.ndarray], stops: list[np.ndarray]) -> Demand:
        """The union of several sets of runs."""
        a = np.concatenate(starts) if starts else np.zeros(0, np.int64)
        b = np.concatenate(stops) if stops else np.zeros(0, np.int64)
        if not a.size:
            return cls(numel, a.astype(np.int64), b.astype(np.int64))
        order = np.argsort(a, kind="stable")
        a, b = a[order], b[order]
        reach = np.maximum.accumulate(b)
        new = np.r_[True, a[1:] > reach[:-1]]  # a run starts a new group past everything before it
        first = np.flatnonzero(new)
        last = np.r_[first[1:] - 1, a.size - 1]
        return cls(numel, a[first], reach[last])

    @property
    def elements(self) -> int:
        return int((self.stops - self.starts).sum())

    def chunks(self, grid) -> frozenset[int]:
        """The chunks of ``grid`` (a ``ChunkGrid`` over this tensor) holding a demanded element."""
        key = (grid.shape, grid.chunk_shape)
        if key not in self._chunks:
            hit = set()
            for i in range(grid.n_chunks):
                seg = np.asarray(grid.chunk_runs(i), dtype=np.int64).reshape(-1, 2)
                j = np.searchsorted(self.stops, seg[:, 0], side="right")
                ok = j < self.starts.size
                if np.any(self.starts[j[ok]] < seg[ok, 1]):
                    hit.add(i)
            self._chunks[key] = frozenset(hit)
        return self._chunks[key]


@dataclass(frozen=True)
class Probe:
    """How one canonical tensor reaches the module: its path, the slots its loader writes and, on
    the direct path, the canonical elements it reads (``demand``; None: every element)."""

    path: str
    slots: tuple[int, ...] = ()
    reason: str = ""
    demand: Demand | None = None


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
    demand = probe_demand(module, slots, name, dtype, shape, target, {k: results[k] for k in ("a", "b")}, (a, b))
    return Probe(DIRECT, tuple(sorted(target)), demand=demand)


PIECE = 1 << 22  # elements per step of the demand probe's passes: its memory stays bounded


def _tags(n: int, k: int, tag: int, storage: np.dtype) -> np.ndarray:
    """Load ``k`` of the index-tagged probe: bits ``k*tag ..`` of each element's flat index, under a marker bit."""
    out = np.empty(n, dtype=storage)
    low, marker = (1 << tag) - 1, 1 << tag
    for at in range(0, n, PIECE):
        idx = np.arange(at, min(n, at + PIECE), dtype=np.uint64)
        out[at: at + idx.size] = ((idx >> np.uint64(k * tag)) & np.uint64(low)) | np.uint64(marker)
    return out


def probe_demand(module, slots: list[Slot], name: str, dtype: str, shape: tuple[int, ...], target: set[int],
                 random_out: dict[str, dict[int, torch.Tensor]], random_in: tuple[torch.Tensor, ...]) -> Demand | None:
    """The canonical elements a direct-path loader reads (see module docstring); None (every
    element) where it cannot be told: one-bit dtypes, slots of another width, or a loader whose
    placement is not a copy of whole elements. Memory: the loads' scratch plus ``PIECE``-sized work."""
    dt = DTYPES[dtype]
    n = math.prod(shape)
    if dt.bits < 8 or n == 0:
        return None
    tag = dt.bits - 1  # index bits per load; the top bit marks "written"
    loads = max(1, -(-max(1, (n - 1).bit_length()) // tag))
    outs: list[dict[int, np.ndarray]] = []
    for k in range(loads):
        bits = _tags(n, k, tag, dt.storage)
        _, scratch = _run_on_scratch(module, slots, [(name, tensor_from_bits(bits, dt, shape))], target)
        del bits
        outs.append({i: bits_of(scratch[i]) for i in target})
    ins = [bits_of(v) for v in random_in]
    starts, stops = [], []
    for i in sorted(target):
        if any(o[i].dtype.itemsize != dt.storage.itemsize for o in outs):
            return None
        per = [o[i].view(dt.storage) for o in outs]
        rand = [bits_of(random_out[key][i]).view(dt.storage) for key in ("a", "b")]
        for at in range(0, per[0].size, PIECE):
            src = _sources(per, at, tag, n)
            if src is None:
                return None
            written, src = src
            for value, got in zip(ins, rand):  # the map must reproduce the random loads exactly
                want = np.zeros(min(PIECE, per[0].size - at), dtype=dt.storage)
                want[written] = value[src]
                if not np.array_equal(want, got[at: at + want.size]):
                    return None
            d = Demand.of(n, src)
            starts.append(d.starts)
            stops.append(d.stops)
    return Demand.merged(n, starts, stops)


def _sources(per: list[np.ndarray], at: int, tag: int, n: int) -> tuple[np.ndarray, np.ndarray] | None:
    """For one piece of a slot: the positions written and the canonical element each came from;
    None if the tagged loads do not decode as copies of whole elements."""
    pieces = [o[at: at + PIECE] for o in per]  # unsigned storage: shifts and masks stay in its width
    written = np.flatnonzero(pieces[0] >> tag)
    src = np.zeros(written.size, dtype=np.int64)
    low = (1 << tag) - 1
    for k, o in enumerate(pieces):
        v = o[written]
        if np.count_nonzero(o) != written.size or np.any(v >> tag != 1):
            return None  # the loads disagree on what is written: not a copy of whole elements
        src |= (v & low).astype(np.int64) << (k * tag)
    if src.size and int(src.max()) >= n:
        return None
    return written, src


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

