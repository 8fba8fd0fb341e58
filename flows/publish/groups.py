"""Groups of tensors: the units a publish's encoding is mapped over when it runs on several workers.

A group is a run of consecutive tensor names (in name order) whose raw bytes add up to about a
target (``dcr_core.batches``); a tensor larger than the target is a group of its own. It carries only names and the
array each tensor is stored under, so it travels to a worker as a few hundred bytes, and the
worker reads the tensors and their baseline where it runs (``flows.publish.encode.encode_group``).

Array names are fixed here, for the whole step, before the split: an array's name depends on the
names before it (two tensor names that escape alike get distinct arrays), so naming per group
would make the stored keys depend on the grouping. With names fixed, what a group stores depends
only on its tensors' bits, their baseline and the plan: the stored objects, the manifest and the
policy digest are the same whatever runs the groups and however many there are.
"""

from __future__ import annotations

from dataclasses import dataclass

from dcr_core.batches import batches_for
from flows.publish.plan import PublishPlan
from storage import layout


@dataclass(frozen=True)
class TensorGroup:
    """Tensors ``names`` (in name order) stored under ``arrays``: group ``index`` of ``count``."""

    index: int
    count: int
    names: tuple[str, ...]
    arrays: tuple[str, ...]
    nbytes: int


def unique_array(array: str, used: set[str]) -> str:
    """``array``, or ``array`` with underscores appended until no earlier array has its name."""
    while array in used:  # two names escaping alike: keep arrays distinct
        array += "_"
    used.add(array)
    return array


def array_names(names) -> dict[str, str]:
    """The array of every tensor name, assigned in name order (see module doc)."""
    used: set[str] = set()
    return {n: unique_array(layout.array_segment(n), used) for n in sorted(names)}


def plan_groups(plan: PublishPlan, slots: int) -> list[TensorGroup]:
    """The plan's tensors as groups of about ``options.group_bytes`` (default:
    ``dcr_core.batches.target_bytes`` for ``slots``), consecutive in name order."""
    names = sorted(plan.infos)
    arrays = array_names(names)
    runs = batches_for(((n, plan.infos[n].nbytes) for n in names), slots, plan.options.group_bytes)
    return [TensorGroup(i, len(runs), tuple(r), tuple(arrays[n] for n in r), sum(plan.infos[n].nbytes for n in r))
            for i, r in enumerate(runs)]
