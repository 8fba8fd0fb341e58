"""What ``dcr report`` shows of a run: every committed step's bytes and change rate, keyframes and
restart points, retracted steps, and each receiver's lag behind the latest live step over time.
Read-only; plain data (``report_page`` draws it).

Retraction: a retracted step keeps its row (its bytes are stored until gc) marked ``retracted``,
and counts in no lag from the moment it was retracted (its record's ``retracted_at``): as in ``dcr
status``, lag is live steps newer than the one a receiver holds."""

from __future__ import annotations

from dataclasses import dataclass, field

from dcr_core.chain import DELTA, KEYFRAME
from flows.maintenance.inspect import histories
from storage.catalog import Catalog, utc_epoch, utc_now
from storage.root import Root


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
    retracted: bool = False  # taken back (dcr retract): no refit's target, no receiver's lag
    retracted_at: str | None = None


@dataclass
class LagPoint:
    at: str  # a moment: a step was committed, or the receiver recorded a refit
    step: int  # the step the receiver held then
    lag: int  # live steps newer than that step at that moment (committed, and not retracted by then)


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
        """The newest live step."""
        live = self.live
        return live[-1] if live else None

    @property
    def live(self) -> list[int]:
        return [s.step for s in self.steps if not s.retracted]

    @property
    def retracted(self) -> list[int]:
        return [s.step for s in self.steps if s.retracted]

    def lag_now(self, receiver: str) -> int | None:
        """Live steps newer than the one ``receiver`` holds now (what ``dcr status`` says)."""
        held = self.positions.get(receiver)
        return None if held is None or self.latest is None else sum(1 for s in self.live if s > held)

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
        retraction = cat.retraction(step)
        report.steps.append(StepPoint(
            step, marker.kind, marker.base_step, marker.committed_at, int(s.get("bytes_stored") or 0),
            int(s.get("bytes_full") or 0), s.get("change_rate") if marker.kind == DELTA else None,
            s.get("tensors_changed"), s.get("tensors"), marker.kind == KEYFRAME or snapshot > 0, snapshot,
            retraction is not None, None if retraction is None else retraction.retracted_at,
        ))
    commits = [Commit(utc_epoch(p.committed_at), p.step, p.committed_at, _retracted_epoch(p)) for p in report.steps]
    positions = cat.positions()
    report.positions = {rid: rec["step"] for rid, rec in positions.items()}
    records = histories(root)
    for rid in sorted(positions):
        report.receivers[rid] = lag_timeline(commits, records.get(rid, []))
    _extend_to_the_end(report.receivers, commits)
    return report


@dataclass(frozen=True)
class Commit:
    """A committed step as the lag counts it: from ``at`` on, until ``retracted`` (epoch seconds)."""

    at: float | None
    step: int
    stamp: str  # its committed_at, as recorded
    retracted: float | None = None

    def newer_than(self, held: int, t: float) -> bool:
        """Whether this step counts in the lag of a receiver holding ``held`` at moment ``t``."""
        return (self.at is not None and self.at <= t and self.step > held
                and (self.retracted is None or self.retracted > t))


def _retracted_epoch(p: StepPoint) -> float | None:
    """When ``p`` was retracted; a retracted step whose stamp does not parse counts as never live."""
    if not p.retracted:
        return None
    t = utc_epoch(p.retracted_at)
    return float("-inf") if t is None else t


def _lag(commits: list[Commit], held: int, t: float) -> int:
    return sum(1 for c in commits if c.newer_than(held, t))


def _extend_to_the_end(receivers: dict[str, list[LagPoint]], commits: list[Commit]) -> None:
    """End every receiver's timeline at the report's last moment (the last commit or refit), at the
    lag it has then: a line that stops at its last refit would hide the commits after it."""
    moments = [(t, p.at) for points in receivers.values() for p in points if (t := utc_epoch(p.at)) is not None]
    if not moments:
        return
    end, at = max(moments)
    for points in receivers.values():
        last = utc_epoch(points[-1].at) if points else None
        if last is not None and last < end:
            points.append(LagPoint(at, points[-1].step, _lag(commits, points[-1].step, end)))


def lag_timeline(commits: list[Commit], records: list[dict]) -> list[LagPoint]:
    """The receiver's lag at every moment it changed: each of its refits, and each commit and
    retraction after its first refit (a new step makes every receiver one step further behind until
    it refits; a retracted one no longer counts)."""
    refits = [(t, rec["step"], rec["committed_at"]) for rec in records if (t := utc_epoch(rec.get("committed_at"))) is not None]
    if not refits:
        return []
    first = refits[0][0]
    events = sorted([(t, 1, step, at) for t, step, at in refits]
                    + [(c.at, 0, c.step, c.stamp) for c in commits if c.at is not None and c.at >= first]
                    + [(c.retracted, 0, c.step, utc_now(c.retracted)) for c in commits
                       if c.retracted is not None and c.retracted >= first])
    held, points = None, []
    for t, is_refit, step, at in events:
        if is_refit:
            held = step
        if held is None:
            continue
        points.append(LagPoint(at, held, _lag(commits, held, t)))
    return points

