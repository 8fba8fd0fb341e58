"""``dcr materialize`` of a step published from a safetensors file or directory: the published
bytes, exactly (``storage.source_layout``; the files and their record: ``storage.local.materialized``).

``output_kind`` decides what ``--out`` gets: the published file's bytes (``file``), the published
directory's files with their names and index inside the directory ``--out`` (``directory``), or a
file in DCR's state format (None: a step published from tensors or shards, ``as_state``, or a
directory's step written to a ``.safetensors`` path, as before). Staging reads the step's source
layout (checked against its manifest's digest), rebuilds every tensor as any refit does (chunks
verified, each result checked against the step's digest) and writes it at the offset the
published header names, in a temp file beside its destination (a directory's: in the new
directory that replaces it as a whole, ``storage.local.dir_swap``); nothing is installed until
every file is complete (``state_file.install_state``). On workers, ``reserve`` makes the temp files and
``on_workers.rewrite_group`` writes the tensors into them.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass

from dcr_core import events
from dcr_core.errors import UsageError
from flows.options import ReceiveOptions
from storage import reader, source_layout
from storage.local import bundled, dir_swap, materialized, state
from storage.local.safetensors import INDEX_NAME, PlacedWriter
from storage.reader import RefitPlan
from storage.root import open_root
from storage.source_layout import DIRECTORY, FILE, SourceLayout

SUFFIX = ".safetensors"


def output_kind(out: str, source_kind: str | None, as_state: bool = False) -> str | None:
    """How a step whose source was ``source_kind`` (None: no source file) materializes at ``out``."""
    if as_state or source_kind is None:
        return None
    if source_kind == FILE:
        return FILE
    real = os.path.realpath(out)
    if os.path.isdir(real) or (not os.path.exists(real) and not os.fspath(out).endswith(SUFFIX)):
        return DIRECTORY
    return None  # a directory's step to a .safetensors path: one file, in DCR's format


def check_directory(out: str) -> str:
    """The directory ``--out`` names (it may not exist yet; its parent must)."""
    given = os.fspath(out)
    real = os.path.realpath(given)
    if os.path.exists(real) and not os.path.isdir(real):
        raise UsageError(f"{given}: not a directory; the step was published from a directory of shards")
    parent = os.path.dirname(real)
    if not os.path.isdir(parent):
        raise UsageError(f"{given}: directory {parent} does not exist; create it first (dcr writes materializations "
                         "into existing directories only)")
    if os.path.ismount(real):
        raise UsageError(f"{given}: a mount point; dcr materialize replaces the directory as a whole (a reader sees "
                         "one step or the other), so name a directory inside it")
    return real


@dataclass(frozen=True)
class Placed:
    """The staged files of one exact materialization: ``moves`` (temp file, destination), in install
    order; ``where[tensor]``: its temp file; ``offsets[tensor]``: its byte offset there."""

    moves: tuple[tuple[str, str], ...]
    where: dict[str, str]
    offsets: dict[str, int]


def about(plan: RefitPlan) -> dict:
    """What the output's record says (``storage.local.materialized``)."""
    target = reader.manifests(plan)[plan.target_step]
    return {"step": plan.target_step, "policy_digest": target.policy_digest, "root": state.absolute_root(plan.root.url)}


def _layout(plan: RefitPlan, kind: str) -> SourceLayout:
    root = open_root(plan.root)
    lay = source_layout.read(root, reader.manifests(plan, root)[plan.target_step])
    if lay is None or (lay.kind == FILE) != (kind == FILE):
        raise UsageError(f"step {plan.target_step}: no source layout of a {kind} to materialize byte for byte")
    return lay


@contextlib.contextmanager
def _staging(out: str, lay: SourceLayout, kind: str) -> Iterator[tuple[list[PlacedWriter], list]]:
    """A temp file per published file (header written, full size): beside ``out`` (a file), or in
    the new directory that will replace the directory ``out`` (``storage.local.dir_swap``); on any
    failure every temp file is removed (and that new directory)."""
    into = dir_swap.begin(out) if kind == DIRECTORY else None
    writers: list[PlacedWriter] = []
    moves: list[tuple[str, str]] = []
    try:
        for f in lay.files:
            writers.append(PlacedWriter(out if into is None else os.path.join(into, f.name), f.header, f.placed, f.size))
        yield writers, moves
    except BaseException:
        materialized.discard(moves, writers)
        if into is not None:
            dir_swap.discard(out)
        raise


def _finish(out: str, lay: SourceLayout, kind: str, writers: list[PlacedWriter], moves: list) -> None:
    """Close every temp file (fsynced) and stage the index: ``moves`` in install order."""
    for w in writers:
        moves.append((w.finish(), w.path))
    if kind == DIRECTORY and lay.index is not None:
        into = dir_swap.staging(out)
        moves.append((materialized.write_index(into, lay.index), os.path.join(into, INDEX_NAME)))


def stage(plan: RefitPlan, out: str, options: ReceiveOptions, kind: str) -> tuple[tuple[tuple[str, str], ...], int]:
    """Rebuild the step (a fresh materialization: from its restart point) into temp files beside
    their destinations, in this process; ``(moves, bytes pulled)``: each temp file and its
    destination, in install order. Memory: one tensor plus the fetch window."""
    lay = _layout(plan, kind)
    root = open_root(plan.root)
    ms = reader.manifests(plan, root)
    pulled = 0
    with _staging(out, lay, kind) as (writers, moves):
        by_name = {n: w for w, f in zip(writers, lay.files) for n in f.placed}
        target = ms[plan.target_step]
        for name, bits, n in reader.refit_tensors(root, plan, ms, None, options.io_workers, out):
            for held, held_bits in bundled.expand(target.tensors[name], bits):  # a bundle: each member in place
                by_name[held].write(held, held_bits)
            pulled += n
            events.reached("receive.tensor-staged", name=name)
        _finish(out, lay, kind, writers, moves)
    return tuple(moves), pulled


def reserve(plan: RefitPlan, out: str, kind: str) -> Placed:
    """The temp files of a mapped materialization, each with its header and full size, for
    ``rewrite_group`` tasks to write the tensors into."""
    lay = _layout(plan, kind)
    where, offsets = {}, {}
    with _staging(out, lay, kind) as (writers, moves):
        for w, f in zip(writers, lay.files):
            offsets.update(w.reserve())
            where.update(dict.fromkeys(f.placed, w.tmp))
        _finish(out, lay, kind, writers, moves)
    return Placed(tuple(moves), where, offsets)
