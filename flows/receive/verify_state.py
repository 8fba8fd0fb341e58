"""``dcr verify-state PATH``: the full check of a receiver's state file, on demand.

Settles a pending in-place patch first (under the state's lock), then hashes every tensor of the
file against the manifest of the step its header records (read from the ROOT the header records,
or the one given), and compares the block digests kept beside it (``storage.local.sidecar``). A
file that holds its step exactly gets a fresh sidecar, stamped now (so in-place refits trust it
again); one that does not is refused, naming its tensors, and its sidecar is removed (the next
refit then hashes everything and refuses it too). A bundle (``dcr_core.bundles``) is hashed as
the step stores it, its members back to back, and each member checked against its own digest. Run it after anything that may have touched the
file outside DCR (a restore, a copy, a disk error), or on a schedule: in-place refits check only a
sample of the blocks they do not change.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from dcr_core.digest import block_leaves, blocks_root
from dcr_core.errors import StateMismatchError, UsageError
from dcr_core.text import plural
from flows.receive.in_place import members_hold
from storage import reader
from storage.catalog import Catalog
from storage.local import bundled, journal, sidecar, state
from storage.local.safetensors import SafetensorsCheckpoint
from storage.root import RootRef, open_root


@dataclass(frozen=True)
class VerifiedState:
    path: str
    step: int
    root: str
    tensors: int
    nbytes: int
    blocks: int  # block digests checked (0: flat digests)
    sidecar: str  # "agreed", "differed" (blocks differing from the kept digests: see stale_blocks), "absent"
    stale_blocks: int = 0


def verify_state(state_path: str | os.PathLike, root: str | None = None, storage_options: dict | None = None) -> VerifiedState:
    path = state.check_path(state_path)
    if not os.path.isfile(path):
        raise UsageError(f"{os.fspath(state_path)}: no such state file")
    with state.exclusive(path):
        journal.settle(path)
        origin = state.peek_origin(path)
        if origin is None or origin[0] is None:
            raise StateMismatchError(f"{path}: records no step (not a DCR state file)")
        step, policy, recorded_root = origin
        url = root or recorded_root
        if url is None:
            raise UsageError(f"{path}: records no ROOT; give the ROOT it was received from (--root)")
        m = Catalog(open_root(RootRef(url, dict(storage_options or {})))).manifest(step)
        if policy is not None and policy != m.policy_digest:
            raise StateMismatchError(f"{path}: records step {step} of {url} with another policy digest "
                                     f"({policy[:16]}, the step's {m.policy_digest[:16]})")
        block = m.digest_scheme.block_bytes if all(e.pieces is None for e in m.tensors.values()) else None
        kept = sidecar.read(path)
        usable = kept is not None and (kept.step, kept.policy_digest, kept.block_bytes) == (step, m.policy_digest, block)
        leaves: dict[str, np.ndarray] = {}
        bad: list[str] = []
        stale = blocks = 0
        ck = bundled.view(SafetensorsCheckpoint(path), m.bundles())  # block digests kept per stored tensor
        try:
            reader.check_schema(m, ck.infos, path)
            for name in sorted(m.tensors):
                e, bits = m.tensors[name], ck.mapped_bits(name)
                if block is None:
                    ok = e.matches(bits)
                else:
                    leaves[name] = block_leaves(bits, block)
                    blocks += leaves[name].shape[0]
                    ok = blocks_root(block, leaves[name]) == e.digest and members_hold(e, bits)
                    if usable:
                        old = kept.leaves.get(name)
                        if old is None or old.shape != leaves[name].shape:
                            stale += leaves[name].shape[0]
                        else:
                            stale += int(np.count_nonzero(np.any(old != leaves[name], axis=1)))
                if not ok:
                    bad.extend(_named(e, bits))
        finally:
            ck.close()
        held = sum(1 for _ in m.policy_entries())  # tensors the file holds: bundles' members by name
        if bad:
            sidecar.remove(path)
            shown = ", ".join(repr(n) for n in bad[:5]) + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
            are = "is" if len(bad) == 1 else "are"
            raise StateMismatchError(f"{path}: {len(bad)} of {plural(held, 'tensor')} {are} not the bits of "
                                     f"step {step} of {url}: {shown}; receive it again from a keyframe (remove the file)")
        if block is not None:
            sidecar.write(path, sidecar.Sidecar(step, m.policy_digest, block, leaves))
    how = "absent" if not usable else ("differed" if stale else "agreed")
    return VerifiedState(path, step, url, held, sum(e.nbytes for e in m.tensors.values()), blocks, how, stale)


def _named(e, bits: np.ndarray) -> list[str]:
    """What a failed stored tensor names: itself, or the members of a bundle that are not their
    digests (the bundle itself when all are: its own digest is what failed)."""
    if e.members is None:
        return [e.name]
    got = e.members.digests_of(bits, e.scheme)
    return [n for n, a, b in zip(e.members.names, got, e.members.digests) if a != b] or [e.name]
