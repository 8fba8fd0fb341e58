"""A receive that rewrites the state file (and ``dcr materialize``) on workers: tasks mapped over
groups of tensors (``flows.workers``).

The flow plans the refit (as in one process) and reserves the new file: a temp file beside the
state with the header and its full size, each tensor's offset known. Each ``rewrite-group`` task
then rebuilds its tensors where it runs (the held bits read from the state file and checked
against the held step, chunks read from ROOT and verified, moves applied, each result checked
against the target step's tensor digest), writes them at their offsets and fsyncs; it returns
only counts. Once every group is in, the flow installs the file (``state_file.install_state``:
renamed over the state). The file is byte for byte the one an in-process rewrite writes (same
header, metadata and tensors), whatever the grouping. Workers must see the state file's directory
(this machine for ``--workers N``; a shared filesystem for a remote cluster): a worker that cannot
fails in one line naming the file. Any failure leaves the state as it was; the temp file is
removed then (or by the next writer of the state, after a crash). An in-place patch
(``--in-place``) is not mapped: it runs in the flow's process. A materialization of a step
published from a safetensors file or directory reserves the published files instead (their
header bytes, their sizes: ``flows.receive.exact``), and the groups write into those, byte for
byte what one process writes.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field

from dcr_core import events
from dcr_core.batches import batches_for
from dcr_core.errors import UsageError
from flows.receive import exact as exact_files
from storage import reader
from storage.local import bundled, state
from storage.local.safetensors import SafetensorsCheckpoint, StreamingSafetensorsWriter, write_placed
from storage.reader import RefitPlan
from storage.root import open_root


@dataclass(frozen=True)
class Reserved:
    """The temp file a mapped rewrite writes into, each tensor's byte offset in it, and the state
    file the held bits are read from (None: the refit starts from a restart point)."""

    state_path: str
    tmp: str
    offsets: dict[str, int]
    held: str | None = None
    # An exact materialization (``flows.receive.exact``): "file" or "directory", the temp file of
    # each tensor (its offset is in ``offsets``), and the staged files in install order.
    exact: str | None = None
    where: dict[str, str] = field(default_factory=dict)
    moves: tuple[tuple[str, str], ...] = ()

    @property
    def temp_files(self) -> list[str]:
        """Every temp file the groups write into (the staged files of an exact materialization)."""
        return [tmp for tmp, _ in self.moves] or [self.tmp]


@dataclass(frozen=True)
class Group:
    """Tensors ``names`` (in name order): group ``index`` of ``count``."""

    index: int
    count: int
    names: tuple[str, ...]


def reserve_file(plan: RefitPlan, state_path: str, root_url: str | None = None, exact: str | None = None) -> Reserved:
    """The temp file beside ``state_path``: header (the step, its policy digest, ROOT: ``root_url``
    as the caller named it, else the plan's) and full size; a held state's schema is checked
    against its step first. ``exact``: the published files' temp files instead (header bytes as
    published, full size each: ``flows.receive.exact``)."""
    if exact is not None:
        placed = exact_files.reserve(plan, state_path, exact)
        return Reserved(state_path, placed.moves[0][0], placed.offsets, None, exact, placed.where, placed.moves)
    ms = reader.manifests(plan)
    target = ms[plan.target_step]
    held = None
    if plan.current_step is not None and not plan.from_keyframe:
        held = state_path
        with SafetensorsCheckpoint(state_path) as ck:
            reader.check_schema(ms[plan.current_step], bundled.view(ck, ms[plan.current_step].bundles()).infos,
                                state_path)
    writer = StreamingSafetensorsWriter(state_path, list(reader.state_infos(target).values()),
                                        state.metadata(plan.target_step, target.policy_digest,
                                                       root_url or plan.root.url),
                                        header_room=state.HEADER_ROOM)
    try:
        offsets = writer.reserve()
        tmp = writer.finish()
    except BaseException:
        writer.abort()
        raise
    return Reserved(state_path, tmp, offsets, held)


def rewrite_group(plan: RefitPlan, reserved: Reserved, group: Group, io_workers: int = 8) -> dict:
    """Rebuild the group's tensors (verified) and write them at their offsets of the reserved file."""
    events.reached("receive.group-started", step=plan.target_step, group=group.index, groups=group.count)
    if not all(os.path.exists(tmp) for tmp in reserved.temp_files):
        raise UsageError(f"{reserved.state_path}: its temp file {reserved.tmp} is not visible where this task runs; "
                         "run on workers that share the state file's filesystem")
    root = open_root(plan.root)
    ms = reader.manifests(plan, root)
    pulled = [0]
    target = ms[plan.target_step]
    with contextlib.ExitStack() as stack:
        held = None
        if reserved.held is not None:
            ck = stack.enter_context(SafetensorsCheckpoint(reserved.held))
            held = bundled.view(ck, ms[plan.current_step].bundles()).bits

        def tensors():
            for name, bits, n in reader.refit_tensors(root, plan, ms, held, io_workers, reserved.state_path,
                                                      names=group.names):
                pulled[0] += n
                yield from bundled.expand(target.tensors[name], bits)  # a bundle: each member at its place

        placed = {n: (reserved.where.get(n, reserved.tmp), reserved.offsets[n])
                  for n in bundled.member_names(target.tensors, group.names)}
        written = write_placed(placed, tensors())
    events.reached("receive.group-done", step=plan.target_step, group=group.index, groups=group.count)
    return {"tensors": len(group.names), "bytes_written": written, "bytes_pulled": pulled[0]}


def groups_of(plan: RefitPlan, slots: int, group_bytes: int | None = None) -> list[Group]:
    """The target step's tensors in runs of about ``group_bytes`` raw bytes (default:
    ``dcr_core.batches.target_bytes`` for ``slots``), in name order."""
    target = reader.manifests(plan)[plan.target_step]
    names = sorted(target.tensors)
    runs = batches_for(((n, target.tensors[n].nbytes) for n in names), slots, group_bytes)
    return [Group(i, len(runs), tuple(r)) for i, r in enumerate(runs)]
