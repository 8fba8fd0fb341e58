"""What ``dcr report`` shows of a run: every committed step's bytes and change rate, keyframes and
restart points, and each receiver's lag behind the latest step over time. Read-only; plain data
(``report_page`` draws it)."""

from __future__ import annotations

import calendar
import time
from dataclasses import dataclass, field

from dcr_core.chain import DELTA, KEYFRAME
from flows.maintenance.inspect import histories
from storage.catalog import Catalog
from storage.root import Root


def epoch(stamp: str | None) -> float | None:
    try:
        return float(calendar.timegm(time.strptime(stamp, "%Y-%m-%dT%H:%M:%SZ"))) if stamp else None
    except ValueError:
        return None


@dataclass
class StepPoint:
    step: int
    kind: str
    base_step: int | None
    committed_at: str
    bytes_stored: int
    bytes_full: int
    change_rate: float | None  # deltas only
    tensors_changed: int | None
    tensors: int | None
    restart_point: bool  # a keyframe, or a delta that also stores a full snapshot
    snapshot_bytes: int = 0


@dataclass
class LagPoint:
    at: str  # a moment: a step was committed, or the receiver recorded a refit
    step: int  # the step the receiver held then
    lag: int  # committed steps newer than that step at that moment


@dataclass
class RunReport:
    root: str
    generated_at: str
    steps: list[StepPoint] = field(default_factory=list)
    uncommitted: list[int] = field(default_factory=list)  # steps with attempts but no marker
    receivers: dict[str, list[LagPoint]] = field(default_factory=dict)
    positions: dict[str, int] = field(default_factory=dict)

    @property
    def latest(self) -> int | None:
        return self.steps[-1].step if self.steps else None

    @property
    def keyframes(self) -> list[int]:
        return [s.step for s in self.steps if s.kind == KEYFRAME]

    @property
    def restart_points(self) -> list[int]:
        return [s.step for s in self.steps if s.restart_point]

    @property
    def stored_total(self) -> int:
        return sum(s.bytes_stored + s.snapshot_bytes for s in self.steps)

    @property
    def full_total(self) -> int:
        return sum(s.bytes_full for s in self.steps)


def build_report(root: Root) -> RunReport:
    cat = Catalog(root)
    report = RunReport(root.url, time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    for step in cat.listed_steps():
        marker = cat.marker(step)
        if marker is None:
            report.uncommitted.append(step)
            continue
        s = marker.summary
        snapshot = int(s.get("snapshot_bytes") or 0)
        report.steps.append(StepPoint(
            step, marker.kind, marker.base_step, marker.committed_at, int(s.get("bytes_stored") or 0),
            int(s.get("bytes_full") or 0), s.get("change_rate") if marker.kind == DELTA else None,
            s.get("tensors_changed"), s.get("tensors"), marker.kind == KEYFRAME or snapshot > 0, snapshot,
        ))
    commits = [(epoch(p.committed_at), p.step) for p in report.steps]
    positions = cat.positions()
    report.positions = {rid: rec["step"] for rid, rec in positions.items()}
    records = histories(root)
    stamps = {p.step: p.committed_at for p in report.steps}
    for rid in sorted(positions):
        report.receivers[rid] = lag_timeline(commits, records.get(rid, []), stamps)
    return report


def lag_timeline(commits: list[tuple[float | None, int]], records: list[dict], stamps: dict[int, str]) -> list[LagPoint]:
    """The receiver's lag at every moment it changed: each of its refits, and each commit after its
    first refit (a new step makes every receiver one step further behind until it refits)."""
    refits = [(t, rec["step"], rec["committed_at"]) for rec in records if (t := epoch(rec.get("committed_at"))) is not None]
    if not refits:
        return []
    events = sorted([(t, 1, step, at) for t, step, at in refits]
                    + [(t, 0, step, stamps[step]) for t, step in commits if t is not None and t >= refits[0][0]])
    held, points = None, []
    for t, is_refit, step, at in events:
        if is_refit:
            held = step
        if held is None:
            continue
        lag = sum(1 for ct, s in commits if ct is not None and ct <= t and s > held)
        points.append(LagPoint(at, held, lag))
    return points
