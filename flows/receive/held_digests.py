"""Whether a live target still holds the bits DCR left in it: one digest per module of everything
the module holds, read whole, and the check both live receivers make with them (a torch module,
``flows.receive.module_pipeline``; an engine's worker, ``flows.receive.engine``).

Memory has no change time. An in-place torch op bumps a tensor's version counter, but a write
through ``.data`` (what vLLM-style loaders do), a numpy view of the storage, a copy by another
device, stream or process, or a rebuild of a repacked kernel does not; only the bytes say what the
target holds. So the digests read them all: per module (by qualified name), BLAKE3 over the name,
dtype, shape and raw bytes of every tensor it holds itself (``live_tensors.module_tensors``:
parameters, buffers, tensors kept as attributes or captured by closures) and, for a module that
computes through vLLM's CPU kernel, that kernel's output for a fixed row (``live_tensors.kernel_probe``).

The check, the same for both receivers (a delta is never applied onto bits DCR did not leave):

1. before a refit, while the target serves: every module hashed and compared with the digests
   recorded after DCR's last refit; any difference and the target is *unknown*: it is loaded whole;
2. right before the target is modified: the modules the refit writes (``holders`` of the tensors
   it writes) hashed again and compared; a difference and nothing is applied, the refit fails
   and the target is unknown;
3. after the refit: those modules hashed again for the record; every other module keeps its digest.

A module the refit does not write, rewritten between 1 and 3, is found by the next refit's step 1.

An engine's pause window keeps only what must run there (``flows.receive.engine_apply``): step 2
in full for the modules patched in place (a patch writes some elements: the rest must be what the
prepare saw) and as *stamps* (``stamps_of``: a few sampled blocks of every tensor) for every other
module (a layer reloaded whole does not depend on what it held: the stamps are there to notice
another reload of the engine between the prepare and the pause, and refuse). Step 3 runs no kernel
in the pause: it keeps a reference to each kernel the modules now compute through (``kernels_of``)
and, once the engine serves again, hashes the bytes (``digests_of`` with those kernels), with the
stamps taken at the end of the pause compared again after them. A kernel module's digest is then
``Pending``: its kernel part is read back by the next call that runs in the engine's own thread
anyway (the next prepare reads every kernel back; ``resolve``), and only if the module still
computes through the very kernel the pause left (by identity: a rebuilt kernel is a new callable),
else the engine is unknown.

Cost: one read of the whole target per refit, before it is modified (0.11 s per GiB of BF16 on
CPU with 2 free cores; hashing every block on one thread took 0.185 s), plus two reads of the
modules the refit writes; no memory for CPU tensors, host copies of at most ``HOST_CHUNK_BYTES``
for device ones. Checking stamps (version counter, data pointer) and one sampled 1 MiB block per
tensor instead costs 0.009 s per GiB but misses a one-element write through ``.data`` to a 44 MiB
tensor 19 times in 20, and every tensor kept as a plain attribute (docs/ARCHITECTURE.md,
"Live-module receivers").
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Iterable

import blake3
import numpy as np
import torch

from flows.receive.live_tensors import has_kernel, kernel_probe, module_tensors, raw_bytes

HOST_CHUNK_BYTES = 64 << 20
STAMP_BLOCKS = 32  # sampled blocks per tensor (evenly spread, first and last byte included) ...
STAMP_BLOCK_BYTES = 64  # ... of this many bytes: 2 KiB per tensor


def _hasher() -> blake3.blake3:
    return blake3.blake3(max_threads=blake3.blake3.AUTO)  # every core: the engine's pause waits on it


def _update(h: blake3.blake3, t: torch.Tensor) -> None:
    """Feed ``t``'s raw bytes, row-major: a CPU tensor in place, any other through bounded host copies."""
    t = t.detach()
    if t.device.type == "cpu" and t.is_contiguous():
        h.update(raw_bytes(t))
        return
    flat = t.contiguous().reshape(-1).view(torch.uint8) if t.numel() else t.new_empty(0, dtype=torch.uint8)
    for at in range(0, flat.numel(), HOST_CHUNK_BYTES):
        h.update(flat[at : at + HOST_CHUNK_BYTES].cpu().numpy())


def _held_hasher(name: str, mod: torch.nn.Module) -> tuple[blake3.blake3, bool]:
    """A hasher fed with what ``mod`` holds itself (its digest but the kernel's part), and whether it holds any."""
    h, held = _hasher(), False
    for tname, t in module_tensors(f"{name}." if name else "", mod):
        h.update(f"{tname}\0{t.dtype}\0{tuple(t.shape)}\0".encode())
        _update(h, t)
        held = True
    return h, held


def _with_kernel(h: blake3.blake3, probe: torch.Tensor) -> str:
    h.update(b"<kernel>\0")
    _update(h, probe)
    return h.hexdigest()


@torch.inference_mode()
def module_digest(name: str, mod: torch.nn.Module, probe: torch.Tensor | None = None) -> str | None:
    """BLAKE3 of what ``mod`` holds itself and of its kernel's output (None: it holds nothing);
    ``probe``: that output, already read (``probes_of``)."""
    h, held = _held_hasher(name, mod)
    if has_kernel(mod):
        return _with_kernel(h, kernel_probe(mod) if probe is None else probe)
    return h.hexdigest() if held else None


KERNEL_REPLACED = "<kernel replaced>"  # a resolved digest no module hashes to: the kernel is not the one recorded


class Pending:
    """A module's digest whose kernel part is read later, in the engine's thread (``resolve``):
    the hash of what the module holds itself, and the kernel it computes through, by identity
    (``kernels_of``). Nothing outside native code writes a built kernel's packed weights: an
    engine rebuilds a kernel by assigning a new callable (vLLM's ``dispatch_cpu_unquantized_gemm``
    does), so the same callable reads back what it held when it was recorded."""

    __slots__ = ("_hasher", "kernel")

    def __init__(self, hasher: blake3.blake3, kernel: Callable[[], object | None]):
        self._hasher, self.kernel = hasher, kernel

    def resolve(self, mod: torch.nn.Module | None, probe: torch.Tensor | None = None) -> str:
        """The digest, with ``mod``'s kernel output (``probe``, or read now: the engine's thread only),
        or ``KERNEL_REPLACED`` when ``mod`` no longer computes through the recorded kernel."""
        current = vars(mod).get("cpu_linear") if mod is not None and has_kernel(mod) else None
        if current is None or self.kernel() is not current:
            return KERNEL_REPLACED
        with torch.inference_mode():
            return _with_kernel(self._hasher.copy(), kernel_probe(mod) if probe is None else probe)

    def __repr__(self) -> str:
        return "Pending(<kernel>)"


def kernels_of(model: torch.nn.Module, names: Iterable[str] | None = None) -> dict[str, Callable[[], object | None]]:
    """Module name -> a reference to the kernel it computes through now (a weak one where the
    callable allows it), for the modules ``names`` (None: all) that have one: what the pause keeps
    of the kernels it rebuilt, instead of reading them back (``Pending``)."""
    wanted = None if names is None else set(names)
    out = {}
    for name, mod in model.named_modules():
        if (wanted is None or name in wanted) and has_kernel(mod):
            fn = vars(mod)["cpu_linear"]
            try:
                out[name] = weakref.ref(fn)
            except TypeError:  # a callable without weak references: kept alive until resolved
                out[name] = lambda fn=fn: fn
    return out


def pending(digests: dict[str, str | Pending] | None) -> bool:
    """Whether a record still has digests whose kernel part is to be read (``resolve``)."""
    return digests is not None and any(isinstance(d, Pending) for d in digests.values())


def resolve(model: torch.nn.Module, digests: dict[str, str | Pending],
            probes: dict[str, torch.Tensor] | None = None) -> dict[str, str]:
    """``digests`` with every ``Pending`` one completed by its module's kernel output (``probes``:
    already read; the others are read now, so in the engine's thread only)."""
    mods = dict(model.named_modules())
    return {name: d.resolve(mods.get(name), None if probes is None else probes.get(name)) if isinstance(d, Pending)
            else d for name, d in digests.items()}


def digests_of(model: torch.nn.Module, names: Iterable[str] | None = None,
               probes: dict[str, torch.Tensor] | None = None,
               kernels: dict[str, Callable[[], object | None]] | None = None) -> dict[str, str | Pending]:
    """Module name -> digest for every module that holds something (``names``: only those).
    ``probes``: the kernels' outputs already read (``probes_of``), so that no kernel runs here: a
    thread beside the engine's forward passes may then hash (a kernel call shares state with them).
    ``kernels``: the kernels recorded in the pause (``kernels_of``), whose modules' digests are then
    ``Pending`` (their kernel part read later, ``resolve``) and which no kernel runs for either."""
    wanted = None if names is None else set(names)
    out: dict[str, str | Pending] = {}
    for name, mod in model.named_modules():
        if wanted is None or name in wanted:
            probe = None
            if has_kernel(mod):
                if kernels is not None and name in kernels:
                    out[name] = Pending(_held_hasher(name, mod)[0], kernels[name])
                    continue
                if probes is not None and name in probes:
                    probe = probes[name]
                elif probes is not None or kernels is not None:
                    raise KeyError(f"module {name!r}: its kernel's output was not read in the engine's thread")
            d = module_digest(name, mod) if probe is None else module_digest(name, mod, probe)
            if d is not None:
                out[name] = d
    return out


@torch.inference_mode()
def probes_of(model: torch.nn.Module, names: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
    """Module name -> its kernel's output for the fixed probe row, for the modules ``names`` (None:
    all) that compute through a kernel: the part of their digests that must run in the engine's
    own thread (vLLM's CPU kernels keep per-call state: never beside a forward pass)."""
    wanted = None if names is None else set(names)
    return {name: kernel_probe(mod).clone() for name, mod in model.named_modules()
            if (wanted is None or name in wanted) and has_kernel(mod)}


@torch.inference_mode()
def stamps_of(model: torch.nn.Module, names: Iterable[str] | None = None) -> dict[str, str]:
    """Module name -> a stamp of the tensors it holds itself: name, dtype, shape and
    ``STAMP_BLOCKS`` blocks of ``STAMP_BLOCK_BYTES`` sampled evenly over each tensor's bytes (all
    of a smaller one). A few milliseconds for a whole engine (3 ms for 124M parameters on CPU). A reload of the engine's weights
    from another step changes a sampled block of nearly every tensor it writes; a write of a few
    elements between the samples does not (the full digests are the check that sees those). A
    kernel's packed copy is not read (its module's digest reads it through the kernel)."""
    wanted = None if names is None else set(names)
    out = {}
    for name, mod in model.named_modules():
        if wanted is not None and name not in wanted:
            continue
        h, held = _hasher(), False
        for tname, t in module_tensors(f"{name}." if name else "", mod):
            t = t.detach()
            h.update(f"{tname}\0{t.dtype}\0{tuple(t.shape)}\0".encode())
            _update_sampled(h, t)
            held = True
        if held:
            out[name] = h.hexdigest()
    return out


def _update_sampled(h: blake3.blake3, t: torch.Tensor) -> None:
    """Feed ``STAMP_BLOCKS`` blocks of ``t``'s raw bytes, evenly spread (all of them for a small tensor)."""
    whole = STAMP_BLOCKS * STAMP_BLOCK_BYTES
    if t.numel() and t.device.type == "cpu" and t.is_contiguous():
        b = raw_bytes(t)
        h.update(b if b.size <= whole else b[_stamp_index(b.size)])
        return
    flat = t.contiguous().reshape(-1).view(torch.uint8) if t.numel() else t.new_empty(0, dtype=torch.uint8)
    _update(h, flat if flat.numel() <= whole else flat[torch.from_numpy(_stamp_index(flat.numel())).to(flat.device)])


@functools.lru_cache(maxsize=1024)
def _stamp_index(n: int) -> np.ndarray:
    """The byte positions ``_update_sampled`` reads of ``n`` bytes (first and last block included)."""
    starts = np.linspace(0, n - STAMP_BLOCK_BYTES, STAMP_BLOCKS).astype(np.int64)
    index = (starts[:, None] + np.arange(STAMP_BLOCK_BYTES, dtype=np.int64)[None, :]).reshape(-1)
    index.flags.writeable = False
    return index


def unchanged(model: torch.nn.Module, held: dict[str, str] | None, names: Iterable[str] | None = None) -> bool:
    """Whether the modules ``names`` (None: all, and no module more or less) still hash to ``held``."""
    if held is None:
        return False
    if names is None:
        return digests_of(model) == held
    names = set(names)
    return digests_of(model, names) == {k: v for k, v in held.items() if k in names}


def after(model: torch.nn.Module, held: dict[str, str], written: Iterable[str] | None,
          kernels: dict[str, Callable[[], object | None]] | None = None) -> dict[str, str | Pending]:
    """The record after a refit that wrote the modules ``written`` (None: any): those hashed again
    (``kernels``: their kernels, as the pause left them: their digests ``Pending``), every other
    module's digest kept from ``held``."""
    if written is None:
        return digests_of(model, None, kernels=kernels)
    written = set(written)
    return {**{k: v for k, v in held.items() if k not in written}, **digests_of(model, written, kernels=kernels)}


def holders(model: torch.nn.Module, tensors: Iterable[torch.Tensor]) -> set[str]:
    """Names of the modules that hold any of ``tensors``' storages (tied twins included): the
    modules whose digests a write to those tensors changes."""
    storages = {t.untyped_storage().data_ptr() for t in tensors if t.numel()}
    out = set()
    for name, mod in model.named_modules():
        for _, t in module_tensors("", mod):
            if t.numel() and t.untyped_storage().data_ptr() in storages:
                out.add(name)
                break
    return out


def combine(digests: dict[str, str]) -> str:
    """One fingerprint for a map of module digests (``resolve``d: no ``Pending`` one)."""
    if pending(digests):
        raise ValueError("a digest's kernel part is not read yet (held_digests.resolve)")
    h = _hasher()
    for name in sorted(digests):
        h.update(f"{name}\0{digests[name]}\0".encode())
    return h.hexdigest()


def fingerprint(model: torch.nn.Module) -> str:
    """One BLAKE3 over every module's digest: changes when any weight the target computes with
    changes (whoever changed it)."""
    return combine(digests_of(model))
