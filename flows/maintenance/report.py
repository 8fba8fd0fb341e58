"""What ``dcr report`` shows of a run: every committed step's bytes and change rate, keyframes and
restart points, and each receiver's lag behind the latest step over time. Read-only; plain data
(``report_page`` draws it)."""

from __future__ import annotations

from dataclasses import dataclass, field

from dcr_core.chain import DELTA, KEYFRAME
from flows.maintenance.inspect import histories
from storage.catalog import Catalog, utc_epoch, utc_now
from storage.root import Root

epoch = utc_epoch  # a stamp's epoch seconds (to the millisecond; whole seconds in older ROOTs), or None


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
    report = RunReport(root.url, utc_now())
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
    _extend_to_the_end(report.receivers, commits)
    return report


def _extend_to_the_end(receivers: dict[str, list[LagPoint]], commits: list[tuple[float | None, int]]) -> None:
    """End every receiver's timeline at the report's last moment (the last commit or refit), at the
    lag it has then: a line that stops at its last refit would hide the commits after it."""
    moments = [(t, p.at) for points in receivers.values() for p in points if (t := epoch(p.at)) is not None]
    if not moments:
        return
    end, at = max(moments)
    for points in receivers.values():
        last = epoch(points[-1].at) if points else None
        if last is not None and last < end:
            lag = sum(1 for ct, s in commits if ct is not None and ct <= end and s > points[-1].step)
            points.append(LagPoint(at, points[-1].step, lag))


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
