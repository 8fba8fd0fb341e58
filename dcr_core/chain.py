"""Refit path planning: which committed steps a receiver applies, in which direction.

Committed steps form a forest: each delta names its base step, each keyframe is a root. To go
from the step a receiver holds (M) to a target (N) the planner considers
- the delta path: undo deltas from M back to the latest common ancestor C of M and N (XOR masks
  are self-inverse, so only steps whose every tensor is invertible can be undone), then apply
  deltas forward from C to N;
- the keyframe path: load N's nearest restart point (a keyframe, or a delta that also stores a
  full snapshot of its step), then apply deltas forward to N;
and takes the one that pulls fewer stored bytes (the delta path on a tie). Steps before a restart
point may have been deleted (``dcr gc``): a chain may end at a restart point whose base is gone.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import Enum

from dcr_core.errors import IntegrityError, StepNotFoundError

KEYFRAME, DELTA = "keyframe", "delta"  # the two kinds of committed step


class Direction(str, Enum):
    KEYFRAME = "keyframe"
    FORWARD = "forward"
    BACKWARD = "backward"


@dataclass(frozen=True, slots=True)
class StepInfo:
    """What the planner needs to know of one committed step."""

    step: int
    base_step: int | None  # None for a keyframe
    invertible: bool  # every tensor's encoding can be undone (xor/unchanged only)
    stored_bytes: int
    restart_bytes: int | None = None  # bytes to load this step whole (keyframe, or a delta's snapshot)

    @property
    def restart(self) -> bool:
        return self.base_step is None or self.restart_bytes is not None

    @property
    def load_bytes(self) -> int:
        """Stored bytes of loading this step whole (a restart point)."""
        return self.stored_bytes if self.base_step is None else int(self.restart_bytes or 0)


@dataclass(frozen=True, slots=True)
class Move:
    step: int
    direction: Direction


def ancestors(steps: Mapping[int, StepInfo], n: int, partial: bool = False) -> list[int]:
    """``[n, base(n), base(base(n)), ..., keyframe]``; an error if the chain is broken or cyclic.

    Where history was deleted, the chain ends at its last restart point before the gap; with
    ``partial``, at the gap itself (for undo/redo paths, which need no restart point)."""
    out: list[int] = []
    cur: int | None = n
    while cur is not None:
        if cur not in steps:
            if partial and out:
                return out
            cut = max((i for i, x in enumerate(out) if steps[x].restart), default=None)
            if cut is not None:
                return out[: cut + 1]  # history before a restart point was deleted
            raise StepNotFoundError(f"step {cur} (in the chain of step {n}) is not committed")
        if out and cur >= out[-1]:
            raise IntegrityError(f"step {out[-1]} names base step {cur}, which is not earlier")
        out.append(cur)
        cur = steps[cur].base_step
    return out


def plan_path(steps: Mapping[int, StepInfo], current: int | None, target: int) -> list[Move]:
    """The cheapest exact sequence of moves from ``current`` (None: nothing held) to ``target``."""
    chain_n = ancestors(steps, target)
    start = next(i for i, s in enumerate(chain_n) if steps[s].restart)
    keyframe_path = [Move(chain_n[start], Direction.KEYFRAME)] + [
        Move(s, Direction.FORWARD) for s in reversed(chain_n[:start])
    ]
    if current is None or current not in steps:
        return keyframe_path
    if current == target:
        return []
    # undo/redo paths need no restart point: walk both chains as far as history survives
    chain_m = ancestors(steps, current, partial=True)
    history_n = ancestors(steps, target, partial=True)
    common = next((s for s in chain_m if s in set(history_n)), None)
    candidates = [keyframe_path]
    if common is not None:
        undo = chain_m[: chain_m.index(common)]
        redo = list(reversed(history_n[: history_n.index(common)]))
        if all(steps[s].invertible for s in undo):
            candidates.insert(
                0,
                [Move(s, Direction.BACKWARD) for s in undo]
                + [Move(s, Direction.FORWARD) for s in redo],
            )
    return min(candidates, key=lambda path: sum(_cost(steps, m) for m in path))


def _cost(steps: Mapping[int, StepInfo], move: Move) -> int:
    info = steps[move.step]
    return info.load_bytes if move.direction is Direction.KEYFRAME else info.stored_bytes


def plan_direct(
    lookup: Callable[[int], StepInfo], current: int | None, target: int, keyframe_cost: int | None
) -> list[Move] | None:
    """The delta path when one step lies on the other's chain, reading only the steps between.

    ``lookup`` gives a step's StepInfo (it may do I/O; this function does none itself);
    ``keyframe_cost`` is the stored bytes of the keyframe path to ``target`` (recorded in its commit
    marker). Returns the same moves ``plan_path`` would choose, or None when the general planner
    (which reads both chains back to their keyframes) is needed: unrelated steps, a step that
    cannot be undone, a keyframe path that is cheaper, or an unknown keyframe cost.
    """
    if current is None or keyframe_cost is None:
        return None
    if current == target:
        return []
    forward = current < target
    walked: list[int] = []
    cost = 0
    s: int | None = target if forward else current
    stop = current if forward else target
    while s is not None and s > stop:
        info = lookup(s)
        if not forward and not info.invertible:
            return None
        walked.append(s)
        cost += info.stored_bytes
        s = info.base_step
    if s != stop or cost > keyframe_cost:
        return None
    if forward:
        return [Move(x, Direction.FORWARD) for x in reversed(walked)]
    return [Move(x, Direction.BACKWARD) for x in walked]
