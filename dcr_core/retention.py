"""Keyframe policy and retention: when a step should be a keyframe, and which steps must be kept.

Pure decisions over step metadata; the publisher and ``dcr gc`` do the I/O around them.

Keyframe policy: a lineage that only grows makes new receivers (and receivers that fell far
behind) pull the keyframe plus every delta since. The publisher makes a step a new restart point
(its delta plus a full snapshot) when ``every`` steps have passed since the lineage's last restart
point, or when the stored bytes of the deltas since it exceed ``above`` times the full (raw) size.

Retention: a committed step is kept when
- it is one of the newest ``keep_last`` committed steps, or on the chain of one of them back to its
  nearest restart point (a keyframe, or a delta that stores a full snapshot): without those, the
  step cannot be rebuilt;
- a registered receiver holds it, or it lies on that receiver's way to the latest step by deltas
  (back to the common ancestor, then forward);
everything else may be deleted. The latest committed step is always kept. A step whose history was
deleted remains a valid *held* step: a receiver holding it restarts from a restart point.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from dcr_core.chain import StepInfo, ancestors
from dcr_core.errors import UsageError
from dcr_core.text import plural


@dataclass(frozen=True, slots=True)
class KeyframePolicy:
    every: int = 0  # a keyframe once this many steps passed since the lineage's keyframe; 0: never
    above: float = 0.0  # a keyframe once delta bytes since it exceed this fraction of the full size; 0: never

    def __post_init__(self) -> None:
        if self.every < 0:
            raise UsageError(f"keyframe every must be >= 0 steps, got {self.every}")
        if not 0.0 <= self.above:
            raise UsageError(f"keyframe above must be a fraction >= 0, got {self.above}")

    def due(self, step: int, keyframe_step: int | None, delta_bytes: int | None, full_bytes: int | None) -> str | None:
        """Why ``step`` should be a keyframe (a short reason), or None.

        ``keyframe_step`` is the base lineage's keyframe; ``delta_bytes`` the stored bytes of the
        deltas since it (up to the base); ``full_bytes`` the raw size of the policy. Unknown values
        (None) never trigger a keyframe on their own.
        """
        if self.every and keyframe_step is not None and step - keyframe_step >= self.every:
            return f"{plural(step - keyframe_step, 'step')} since keyframe {keyframe_step} (policy: every {self.every})"
        if self.above and delta_bytes is not None and full_bytes and delta_bytes > self.above * full_bytes:
            return (
                f"{delta_bytes} delta bytes since keyframe {keyframe_step} exceed {self.above:g} of the full "
                f"{full_bytes} bytes"
            )
        return None


def restart_chain(steps: Mapping[int, StepInfo], s: int) -> list[int]:
    """``s`` back to its nearest restart point (a keyframe, or a delta with a full snapshot)."""
    chain = ancestors(steps, s)
    end = next(i for i, x in enumerate(chain) if steps[x].restart)
    return chain[: end + 1]


def steps_to_keep(
    steps: Mapping[int, StepInfo], keep_last: int, receivers: Mapping[str, int] | None = None
) -> set[int]:
    """The committed steps that retention keeps (see the module docstring)."""
    if keep_last < 1:
        raise UsageError(f"keep at least the latest step (keep_last >= 1), got {keep_last}")
    if not steps:
        return set()
    newest = sorted(steps)[-keep_last:]
    keep: set[int] = set()
    for s in newest:
        keep.update(restart_chain(steps, s))
    history = ancestors(steps, newest[-1], partial=True)  # the latest step's surviving history
    for held in (receivers or {}).values():
        if held not in steps:
            continue  # a record of a step that is gone: nothing left to protect
        keep.add(held)
        chain = ancestors(steps, held, partial=True)  # its history may be gone already
        common = next((s for s in chain if s in history), None)
        if common is not None:  # the deltas back to the common ancestor and forward to the latest
            keep.update(chain[: chain.index(common) + 1])
            keep.update(history[: history.index(common) + 1])
    return keep


def steps_to_delete(steps: Iterable[int], keep: set[int]) -> list[int]:
    """Committed steps not kept, oldest first."""
    return sorted(s for s in steps if s not in keep)
