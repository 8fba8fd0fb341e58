"""Bundles: many small tensors of one dtype stored as one flat tensor.

A checkpoint of tens of thousands of small tensors (the experts of a mixture-of-experts model)
would cost per tensor everywhere: a manifest entry, a chunk grid, an encode call, a digest pass, an
apply call. A bundle holds small tensors of one dtype back to back (in the order the keyframe's
checkpoint file holds them, else by name; at most ``MAX_BUNDLE_BYTES``) as one 1-D tensor
(``bundle_name``): it is chunked, encoded, packed, streamed, mirrored and applied exactly like any
tensor, so the work per step follows the bytes, not the count. Its members stay first-class: each
keeps its name, shape and digest (in the manifest's ``bundles`` table, ``storage.manifest``), the
policy digest covers members as if they were stored alone, and receivers hold members by name
(``storage.local.bundled`` turns a held state's members into bundles and back).

Which tensors are bundled is fixed by the keyframe that starts a lineage (``plan``): tensors below
``below_bytes``, when a dtype holds at least ``min_tensors`` of them; every delta of the lineage
keeps its base's bundles, so the moves of a refit share one layout.

Pure: no I/O, no torch.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import blake3
import numpy as np
from dcr_zarr_codec._b3runs import runs_hex

from dcr_core.digest import BLOCKS_SCHEME, BlockHasher, DigestScheme, TensorHasher
from dcr_core.dtypes import DTYPES, TensorInfo

PREFIX = "%bundle."  # a bundle's name: PREFIX + dtype + "." + k (k: the first free number)
DEFAULT_BELOW_BYTES = 1 << 20  # tensors smaller than this may be bundled
DEFAULT_MIN_TENSORS = 256  # ... when a dtype holds at least this many of them
MAX_BUNDLE_BYTES = 4 << 20  # a bundle is read and applied whole, like a tensor: kept to a chunk's size,
# which the allocator serves from memory it reuses (the dcr command maps anything over 8 MiB afresh,
# and fresh pages cost a fault each: flows.cli)


@dataclass(frozen=True, eq=False)
class Members:
    """The tensors a bundle holds, in order: names, shapes, and (once known) their digests."""

    dtype: str
    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    digests: tuple[str, ...] = ()
    changed: tuple[int, ...] = ()  # a delta's elements changed per member (advisory, like an entry's count)
    starts: np.ndarray = field(init=False, repr=False)  # element offsets, n + 1 of them

    def __post_init__(self) -> None:
        numels = np.fromiter(map(math.prod, self.shapes), np.int64, len(self.shapes))
        starts = np.zeros(len(self.shapes) + 1, np.int64)
        np.cumsum(numels, out=starts[1:])
        object.__setattr__(self, "starts", starts)

    def __len__(self) -> int:
        return len(self.names)

    def __eq__(self, other) -> bool:
        return isinstance(other, Members) and (self.dtype, self.names, self.shapes, self.digests) == (
            other.dtype, other.names, other.shapes, other.digests)

    __hash__ = None  # type: ignore[assignment]

    @property
    def numel(self) -> int:
        return int(self.starts[-1])

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPES[self.dtype].itemsize

    def same_layout(self, other: Members | None) -> bool:
        """Whether ``other`` bundles the same tensors in the same order (digests aside)."""
        return other is not None and (self.dtype, self.names, self.shapes) == (other.dtype, other.names, other.shapes)

    def with_digests(self, digests: Iterable[str], changed: Iterable[int] = ()) -> Members:
        return Members(self.dtype, self.names, self.shapes, tuple(digests), tuple(changed))

    @property
    def changed_names(self) -> list[str]:
        """Members a delta changed (by its per-member counts; all when it has none)."""
        if not self.changed:
            return list(self.names)
        return [n for n, c in zip(self.names, self.changed) if c]

    def to_dict(self) -> dict:
        return {"names": list(self.names), "shapes": [list(s) for s in self.shapes], "digests": list(self.digests),
                **({"changed": list(self.changed)} if self.changed else {})}

    def changed_per_member(self, positions: np.ndarray) -> tuple[int, np.ndarray]:
        """How many of ``positions`` (ascending element positions in the bundle) fall in each member:
        ``(first member, counts)`` for the members from the first to the last position's (the
        members' starts looked up among the positions: one lookup per member spanned, not per
        position)."""
        if not positions.size:
            return 0, np.zeros(0, np.int64)
        lo = int(np.searchsorted(self.starts, positions[0], side="right")) - 1
        hi = int(np.searchsorted(self.starts, positions[-1], side="right"))  # members lo..hi-1
        edges = np.searchsorted(positions, self.starts[lo:hi + 1])
        edges[-1] = positions.size
        return lo, np.diff(edges)

    def infos(self) -> Iterable[TensorInfo]:
        return (TensorInfo(n, self.dtype, s) for n, s in zip(self.names, self.shapes))

    def split(self, flat: np.ndarray) -> Iterable[tuple[str, np.ndarray]]:
        """``(name, flat view)`` of every member in the bundle's flat bits (views, no copies)."""
        st = self.starts.tolist()
        return ((n, flat[a:b]) for n, a, b in zip(self.names, st, st[1:]))

    def byte_starts(self) -> np.ndarray:
        return self.starts * DTYPES[self.dtype].itemsize

    def digests_of(self, flat: np.ndarray, scheme: DigestScheme) -> tuple[str, ...]:
        """Every member's digest (in ``scheme``) from the bundle's flat bits."""
        return member_digests(np.ascontiguousarray(flat).view(np.uint8), self.byte_starts(), scheme)

    def check(self, flat: np.ndarray, scheme: DigestScheme) -> str | None:
        """The first member whose bits in ``flat`` are not its digest, or None."""
        got = self.digests_of(flat, scheme)
        if got == self.digests:
            return None
        return next(n for n, a, b in zip(self.names, got, self.digests) if a != b)



def member_digests(raw: np.ndarray, byte_starts: np.ndarray, scheme: DigestScheme) -> tuple[str, ...]:
    """Digests of the byte runs ``raw[s[i]:s[i+1]]`` (members of a bundle), equal to ``scheme.digest``
    of each run: all in one call of the C kernel (``dcr_zarr_codec._b3runs``, without the interpreter
    lock; under the block scheme a run of at most one block is BLAKE3 of the scheme's head and the
    run's own digest, and an empty run the head's), a member of several blocks on its own."""
    raw = np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
    starts = np.ascontiguousarray(byte_starts, np.int64)
    if scheme.block_bytes is None:
        return runs_hex(raw, starts)
    block = scheme.block_bytes
    head = f"{BLOCKS_SCHEME}\n{block}\n".encode()
    out = runs_hex(raw, starts, head)
    sizes = np.diff(starts)
    odd = np.flatnonzero((sizes == 0) | (sizes > block))
    if not odd.size:
        return out
    fixed = list(out)
    empty = blake3.blake3(head).hexdigest()
    for i in odd.tolist():  # members of no byte or of several blocks: few, if any
        a, b = int(starts[i]), int(starts[i + 1])
        fixed[i] = empty if a == b else scheme.digest(raw[a:b])
    return tuple(fixed)


def bundle_name(dtype: str, k: int) -> str:
    return f"{PREFIX}{dtype}.{k}"


def plan(infos: Mapping[str, TensorInfo], below_bytes: int, min_tensors: int,
         order: Mapping[str, tuple] | None = None) -> dict[str, Members]:
    """The bundles of a new lineage: per dtype, its tensors of fewer than ``below_bytes`` bytes,
    when there are at least ``min_tensors`` (and two) of them; none when ``below_bytes`` is 0. Members
    go in ``order`` (a sort key per name: where a checkpoint file holds each tensor, so that reading
    a bundle from that file, and from the next steps' files written alike, takes few reads), else in
    name order. A bundle's name avoids every tensor name."""
    if below_bytes <= 0:
        return {}
    small: dict[str, list[TensorInfo]] = {}
    for name in sorted(infos, key=None if order is None else lambda n: (order[n], n)):
        i = infos[name]
        if i.nbytes < below_bytes:
            small.setdefault(i.dtype, []).append(i)
    out = {}
    for dtype in sorted(small):
        found = small[dtype]
        if len(found) < max(2, min_tensors):
            continue
        k, run_bytes = 0, 0
        run: list[TensorInfo] = []
        for member in [*found, None]:
            if member is None or (run and run_bytes + member.nbytes > MAX_BUNDLE_BYTES):
                while bundle_name(dtype, k) in infos:
                    k += 1
                out[bundle_name(dtype, k)] = Members(dtype, tuple(x.name for x in run), tuple(x.shape for x in run))
                k, run, run_bytes = k + 1, [], 0
            if member is not None:
                run.append(member)
                run_bytes += member.nbytes
    return out


def stored_infos(infos: Mapping[str, TensorInfo], bundles: Mapping[str, Members]) -> dict[str, TensorInfo]:
    """What is stored for tensors ``infos``: members replaced by their bundle (a flat tensor)."""
    bundled = {n for m in bundles.values() for n in m.names}
    out = {n: i for n, i in infos.items() if n not in bundled}
    for b, m in bundles.items():
        out[b] = TensorInfo(b, m.dtype, (m.numel,))
    return out


def policy_infos(stored: Mapping[str, TensorInfo], bundles: Mapping[str, Members]) -> dict[str, TensorInfo]:
    """The tensors behind stored ``stored`` (bundles replaced by their members), in stored-name order
    with each bundle's members in bundle order: the order a receiver's state file is laid out in, so
    that a bundle is one contiguous range of it."""
    out: dict[str, TensorInfo] = {}
    for name in sorted(stored):
        m = bundles.get(name)
        if m is None:
            out[name] = stored[name]
        else:
            out.update((i.name, i) for i in m.infos())
    return out


class MembersHasher:
    """Members' digests from a bundle's bits fed in order, chunk by chunk (equal to
    ``Members.digests_of`` of the whole), with the elements each member changed (``changes``)."""

    def __init__(self, members: Members, scheme: DigestScheme):
        self.members, self.scheme = members, scheme
        self._bs = members.byte_starts().tolist()
        self._next = 0  # the first member not finished
        self._partial: TensorHasher | BlockHasher | None = None  # its hasher, when it began in an earlier chunk
        self._at = 0  # bytes fed so far
        self.digests: list[str] = []
        self.changed = np.zeros(len(members), np.int64)

    def update(self, bits: np.ndarray) -> None:
        raw = np.ascontiguousarray(bits).reshape(-1).view(np.uint8)
        a, b = self._at, self._at + raw.size
        bs, n = self._bs, len(self.members)
        if self._partial is not None:
            end = bs[self._next + 1]
            self._partial.update(raw[: min(end, b) - a])
            if end > b:
                self._at = b
                return
            self.digests.append(self._partial.hexdigest())
            self._partial = None
            self._next += 1
        first = self._next
        last = first  # members that end within this chunk: [first, last)
        while last < n and bs[last + 1] <= b:
            last += 1
        if last > first:
            self.digests.extend(member_digests(raw, np.array(bs[first:last + 1], np.int64) - a, self.scheme))
        self._next = last
        if last < n and bs[last] < b:  # a member that goes on into the next chunk
            self._partial = self.scheme.hasher()
            self._partial.update(raw[bs[last] - a:])
        self._at = b

    def count(self, positions: np.ndarray) -> None:
        """Add changed elements at ``positions`` (element positions in the bundle)."""
        if positions.size:
            lo, counts = self.members.changed_per_member(positions)
            self.changed[lo:lo + counts.size] += counts

    def finish(self, changes: bool) -> Members:
        """The members with their digests (and, for a delta, changed counts)."""
        while self._next < len(self.members):  # empty members at the end
            if self._partial is not None:
                self.digests.append(self._partial.hexdigest())
                self._partial = None
            else:
                self.digests.extend(member_digests(np.empty(0, np.uint8), np.zeros(2, np.int64), self.scheme))
            self._next += 1
        if len(self.digests) != len(self.members):
            raise ValueError(f"bundle fed {self._at} bytes of {self.members.nbytes}")
        return self.members.with_digests(self.digests, self.changed.tolist() if changes else ())
