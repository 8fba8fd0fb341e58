"""Tensors held by name, seen through bundles (``dcr_core.bundles``): each bundle one flat tensor.

A step stores a bundle as one flat tensor while whoever holds the policy (a checkpoint being
published, a receiver's state file, a baseline held in memory) holds its members by name.
``BundledView`` shows such a holder as the step stores it: a bundle whose members it holds is a
flat tensor of their bits back to back (read from a file in as few reads as the members' placement
allows: one where they lie back to back in bundle order, as in every state file DCR writes; such
a bundle also has a data offset and a memory map like a tensor's, which an in-place patch
addresses), a tensor held as a bundle already (the publisher's baseline cache) is itself, other
tensors are unchanged. ``write_stored`` writes a bundle's bits into a writer laid out by
``dcr_core.bundles.policy_infos`` (its members back to back) with one write.
"""

from __future__ import annotations

import operator
import os
from collections.abc import Mapping

import numpy as np

from dcr_core.bundles import Members, stored_infos
from dcr_core.dtypes import DTYPES
from dcr_core.errors import InvalidCheckpointError

_DTYPE, _SHAPE = operator.attrgetter("dtype"), operator.attrgetter("shape")


class BundledView:
    """``inner`` (``infos``, ``bits(name)``; a checkpoint also ``read_into``) with ``bundles`` flat."""

    def __init__(self, inner, bundles: Mapping[str, Members]):
        self.inner = inner
        self.path = getattr(inner, "path", "")
        held = inner.infos
        self.bundles = {}
        for b, m in bundles.items():
            if b in held:  # held as stored already
                continue
            try:  # every member held, with its dtype and shape (whole columns compared, in C)
                infos = [held[n] for n in m.names]
            except KeyError:
                continue
            if set(map(_DTYPE, infos)) == {m.dtype} and list(map(_SHAPE, infos)) == list(m.shapes):
                self.bundles[b] = m
        self.infos = stored_infos(held, self.bundles)
        self.file = hasattr(inner, "read_into")
        self._runs: dict[str, tuple[np.ndarray, list, list]] = {}

    def __getattr__(self, name):  # close, metadata, ...: the holder's own
        return getattr(self.inner, name)

    def _file_runs(self, bundle: str) -> tuple[np.ndarray, list, list]:
        """Where a bundle's bytes lie in the checkpoint: runs of members back to back in one file,
        as (bundle byte offset of each run, file descriptor, file offset)."""
        runs = self._runs.get(bundle)
        if runs is None:
            m = self.bundles[bundle]
            fds, offs = self.inner.files_of(m.names)
            bs = m.byte_starts()
            # A member starts a new run unless it lies in its predecessor's file right after it.
            new = np.ones(len(m), bool)
            new[1:] = (fds[1:] != fds[:-1]) | (offs[1:] != offs[:-1] + np.diff(bs)[:-1])
            first = np.flatnonzero(new)
            runs = self._runs[bundle] = (np.append(bs[first], bs[-1]), fds[first].tolist(), offs[first].tolist())
        return runs

    def one_run(self, bundle: str) -> bool:
        """Whether a bundle's members lie back to back in bundle order in one file (as every state file
        DCR writes lays them out): then the bundle is one byte range of it, with a data offset and a
        memory map like a tensor's, which an in-place patch can address (``flows.receive.in_place``)."""
        return self.file and len(self._file_runs(bundle)[1]) == 1

    def data_offset(self, name: str) -> int:
        """Byte offset of a tensor's data in its file; a bundle's is its first member's (one run only)."""
        if name not in self.bundles:
            return self.inner.data_offset(name)
        if not self.one_run(name):
            raise ValueError(f"bundle {name!r}: its members are not back to back in {self.path}")
        return self._file_runs(name)[2][0]

    def mapped_bits(self, name: str) -> np.ndarray:
        """A tensor's raw bits as a read-only memory map (``SafetensorsCheckpoint.mapped_bits``); a
        bundle's where it is one run of its file, else a copy of it read run by run."""
        m = self.bundles.get(name)
        if m is None:
            return self.inner.mapped_bits(name)
        if not self.one_run(name):
            return self.bits(name)
        return self.inner.mapped_range(self.inner.file_named(m.names[0]), self.data_offset(name), m.numel,
                                       DTYPES[m.dtype].storage)

    def bits(self, name: str) -> np.ndarray:
        m = self.bundles.get(name)
        if m is None:
            return self.inner.bits(name)
        out = np.empty(m.numel, DTYPES[m.dtype].storage)
        if self.file:
            return self.read_into(name, 0, out)
        for n, part in m.split(out):
            part[:] = np.ascontiguousarray(self.inner.bits(n)).reshape(-1).view(out.dtype)
        return out

    def read_into(self, name: str, start: int, out: np.ndarray) -> np.ndarray:
        """Elements ``[start, start + out.size)`` of a tensor (a bundle: of its members' bits back to
        back) read into ``out``, as ``SafetensorsCheckpoint.read_into``."""
        m = self.bundles.get(name)
        if m is None:
            return self.inner.read_into(name, start, out)
        it = DTYPES[m.dtype].itemsize
        if out.ndim != 1 or not out.flags.c_contiguous or start < 0 or start + out.size > m.numel:
            raise ValueError(f"bundle {name!r}: elements [{start}, {start + out.size}) out of range")
        if not self.file:
            out[:] = self.bits(name)[start:start + out.size]
            return out
        run_starts, fds, offs = self._file_runs(name)
        view = out.view(np.uint8).data
        a, b = start * it, (start + out.size) * it
        r = int(np.searchsorted(run_starts, a, side="right")) - 1
        at = a
        while at < b:
            stop = min(b, int(run_starts[r + 1]))
            want, got = stop - at, 0
            while got < want:
                n = _pread(fds[r], view[at - a + got: stop - a], offs[r] + at - int(run_starts[r]) + got, self.path, name)
                if not n:
                    raise InvalidCheckpointError(f"{self.path}: bundle {name!r} is truncated")
                got += n
            at = stop
            r += 1
        return out


def _pread(fd: int, view: memoryview, at: int, path: str, name: str) -> int:
    try:
        return os.preadv(fd, [view], at)
    except OSError as e:
        raise InvalidCheckpointError(f"{path}: cannot read bundle {name!r} ({e.strerror or e})") from None


def view(inner, bundles: Mapping[str, Members]):
    """``inner`` seen through ``bundles`` (itself when none applies)."""
    return BundledView(inner, bundles) if bundles else inner


def write_stored(writer, entry, bits: np.ndarray) -> None:
    """Write a stored tensor's bits (a bundle: its members, back to back) into ``writer``."""
    if entry.members is None:
        writer.write(entry.name, bits)
    else:
        writer.write_run(entry.members.names, bits)


def expand(entry, bits: np.ndarray):
    """``(name, bits)`` of the tensors a stored entry holds: itself, or a bundle's members (views)."""
    if entry.members is None:
        return ((entry.name, bits),)
    return entry.members.split(bits)


def member_names(entries, names) -> list[str]:
    """The held tensors behind stored ``names`` of ``entries`` (bundles replaced by their members)."""
    out: list[str] = []
    for n in names:
        m = entries[n].members
        out.extend((n,) if m is None else m.names)
    return out
