"""What a live module holds, slot by slot: block digests of every parameter and buffer, and the
checks that decide whether the module still holds what DCR last put there.

A refit of a live module (``flows.receive.module``) needs to know that the module still holds the
step it recorded, or a delta would patch the wrong bits. Hashing every parameter before and after
every refit costs two passes over the whole model; instead DCR keeps, per slot, its block digests
(1 MiB blocks, ``dcr_core.digest``) and a *stamp* (dtype, shape, device, data pointer, the tensor's
version counter), and after a refit re-hashes only the slots the refit wrote (the probe knows which
slots each canonical tensor's loader writes) plus any slot whose stamp moved.

Trust policy (``still_holds``), checked before every delta refit:
- every slot is there under the same name, with the same stamp: a slot replaced (``.data = ...``,
  a new tensor, a move to another device) or changed by an in-place torch op on the parameter
  (``p.add_``, ``p.copy_``, ``p[...] = ...``: they bump its version counter) is re-hashed whole and
  must match its digests;
- one block drawn at random from every slot is hashed and must match: a slot rewritten through a
  path that bypasses the version counter (``p.data.copy_(...)``, which vLLM-style loaders use, or
  numpy views of the storage) is caught for certain when the write touched every block (a reload
  of other weights), and with probability 1/blocks per refit when it touched one block only;
- after a failed apply the check is a full hash (``full=True``).
A module that fails is *unknown*: the next refit loads the step densely. Cost per refit: one block
per slot (at most 1 MiB each) plus the slots the refit wrote, against the whole model before.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import blake3
import numpy as np
import torch

from dcr_core.bits import bits_of
from dcr_core.digest import BlockHasher
from flows.receive.placement import Slot, slots_of

BLOCK_BYTES = 1 << 20
SAMPLED_BLOCKS_PER_SLOT = 1


@dataclass(frozen=True)
class SlotDigest:
    qualname: str
    stamp: tuple
    leaves: np.ndarray  # (blocks, 32) uint8


def _stamp(slot: Slot) -> tuple:
    owner = slot.owner._parameters if slot.is_param else slot.owner._buffers
    held, t = owner[slot.attr], slot.get()
    return (str(t.dtype), tuple(t.shape), str(t.device), t.data_ptr(), held._version)


def _host_bits(t: torch.Tensor) -> np.ndarray:
    t = t.detach()
    if t.device.type != "cpu" or not t.is_contiguous():
        t = t.cpu().contiguous()
    return bits_of(t).reshape(-1)


def _leaves(t: torch.Tensor) -> np.ndarray:
    h = BlockHasher(BLOCK_BYTES)
    h.update(_host_bits(t))
    return h.leaves()


def _block(t: torch.Tensor, k: int) -> bytes:
    """Block ``k`` of the slot's bits, hashed (only that block leaves the device)."""
    flat = t.detach().reshape(-1)
    per = BLOCK_BYTES // t.element_size()
    return blake3.blake3(memoryview(_host_bits(flat[k * per : (k + 1) * per])).cast("B")).digest()


def record(module, previous: list[SlotDigest] | None = None, written: set[str] | None = None) -> list[SlotDigest]:
    """The module's slot digests now: a slot named in ``written``, a new one or one whose stamp
    moved is hashed; every other slot keeps its digests from ``previous`` (None: hash everything)."""
    before = {d.qualname: d for d in previous or ()}
    out = []
    for slot in slots_of(module):
        stamp, old = _stamp(slot), before.get(slot.qualname)
        if old is not None and old.stamp == stamp and slot.qualname not in (written or ()):
            out.append(old)
        else:
            out.append(SlotDigest(slot.qualname, stamp, _leaves(slot.get())))
    return out


def fingerprint(digests: list[SlotDigest]) -> str:
    """One digest of the whole module (names, dtypes, shapes and every block digest)."""
    h = blake3.blake3()
    for d in digests:
        h.update(f"{d.qualname}\0{d.stamp[0]}\0{d.stamp[1]}\0".encode())
        h.update(d.leaves.tobytes())
    return h.hexdigest()


def still_holds(module, digests: list[SlotDigest] | None, full: bool = False, rng: random.Random | None = None) -> bool:
    """Whether ``module`` still holds the bits ``digests`` describe, by the policy in the module doc
    (``full``: every slot hashed whole)."""
    if digests is None:
        return False
    slots = slots_of(module)
    if [s.qualname for s in slots] != [d.qualname for d in digests]:
        return False
    rng = rng or random.SystemRandom()
    for slot, d in zip(slots, digests):
        t = slot.get()
        if full or _stamp(slot) != d.stamp:
            if (str(t.dtype), tuple(t.shape)) != d.stamp[:2] or not np.array_equal(_leaves(t), d.leaves):
                return False
            continue
        n = d.leaves.shape[0]
        for k in rng.sample(range(n), min(SAMPLED_BLOCKS_PER_SLOT, n)):
            if _block(t, k) != d.leaves[k].tobytes():
                return False
    return True
