"""``dcr ls`` and ``dcr verify``: what ROOT holds, and whether its stored bytes match their digests."""

from __future__ import annotations

from dataclasses import dataclass, field

from dcr_core import events
from dcr_core.batches import batches_for
from dcr_core.chain import DELTA, Direction, Move
from dcr_core.errors import DCRError, IntegrityError
from flows.steps import InProcess, Runner, Step, StepTable
from flows.workers import portable_root
from storage import layout, reader, source_layout
from storage.catalog import Catalog
from storage.chunk_io import IO_WORKERS, stream_chunks
from storage.root import Root, RootRef, open_root


@dataclass
class StepRow:
    step: int
    committed: bool
    kind: str = "-"
    base_step: int | None = None
    tensors_changed: int | None = None
    tensors: int | None = None
    bytes_stored: int | None = None
    bytes_full: int | None = None
    change_rate: float | None = None
    receivers: list[str] = field(default_factory=list)  # every receiver that committed the step
    attempts: int = 0
    snapshot_bytes: int | None = None  # a delta that also stores a full copy (a restart point)
    receivers_now: list[str] = field(default_factory=list)  # those of them still at this step
    retracted: bool = False  # committed, then taken back (dcr retract)


def list_steps(root: Root) -> list[StepRow]:
    cat = Catalog(root)
    recorded = {step: cat.receivers(step) for step in cat.listed_steps()}
    where = {rid: rec["step"] for rid, rec in cat.positions(recorded).items()}
    rows = []
    for step in recorded:
        marker = cat.marker(step)
        attempts = len(root.listdir(layout.attempts_dir(step)))
        if marker is None:
            rows.append(StepRow(step, False, attempts=attempts))
            continue
        s = marker.summary
        rows.append(
            StepRow(
                step, True, marker.kind, marker.base_step,
                s.get("tensors_changed"), s.get("tensors"), s.get("bytes_stored"), s.get("bytes_full"),
                s.get("change_rate") if marker.kind == DELTA else None,
                recorded[step], attempts, s.get("snapshot_bytes"),
            )
        )
        rows[-1].receivers_now = [r for r in rows[-1].receivers if where.get(r) == step]
        rows[-1].retracted = cat.retraction(step) is not None
    return rows


def human_bytes(n: int | None) -> str:
    """``n`` bytes for people: 512 B, 3.1 MiB (``-`` for None)."""
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def format_rows(rows: list[StepRow]) -> str:
    committed_col = [
        ("retracted" if r.retracted else "yes") if r.committed
        else f"no ({r.attempts} attempt{'s' if r.attempts != 1 else ''})" for r in rows
    ]
    w = max([9, *map(len, committed_col)])  # the column fits its longest cell
    header = (f"{'STEP':>8}  {'KIND':<8}  {'BASE':>6}  {'COMMITTED':<{w}}  {'CHANGED':>9}  {'STORED':>10}  "
              f"{'FULL':>10}  {'RATE':>8}  RECEIVERS")
    lines = [header]
    for r, committed in zip(rows, committed_col, strict=True):
        changed = "-" if r.tensors_changed is None else f"{r.tensors_changed}/{r.tensors}"
        rate = "-" if r.change_rate is None else f"{100 * r.change_rate:.3f}%"
        lines.append(
            f"{r.step:>8}  {r.kind:<8}  {'-' if r.base_step is None else r.base_step:>6}  {committed:<{w}}  "
            f"{changed:>9}  {human_bytes(r.bytes_stored):>10}  {human_bytes(r.bytes_full):>10}  {rate:>8}  "
            f"{_receivers(r)}"
            + (f"  (+ full snapshot {human_bytes(r.snapshot_bytes)})" if r.snapshot_bytes is not None else "")
        )
    return "\n".join(lines)


def _receivers(r: StepRow) -> str:
    """Receivers at the step now, then those that committed it and moved on."""
    moved = [x for x in r.receivers if x not in r.receivers_now]
    return (",".join(r.receivers_now) + (" " if r.receivers_now and moved else "")
            + (f"(moved on: {','.join(moved)})" if moved else "")) or "-"


@dataclass
class VerifyReport:
    steps: list[int] = field(default_factory=list)
    chunks: int = 0
    bytes: int = 0
    errors: list[str] = field(default_factory=list)
    deep: bool = False
    replayed: list[int] = field(default_factory=list)  # deltas replayed from their restart point (deep)


def _replay(root: Root, plan: reader.RefitPlan, workers: int, names=None) -> None:
    """Apply the plan tensor by tensor (``names`` only, if given), checking every chunk and every
    result (nothing kept)."""
    ms = reader.manifests(plan, root)
    for _ in reader.refit_tensors(root, plan, ms, None, workers, names=names):
        pass


def verify_tensors(root: RootRef, step: int, names: tuple[str, ...] | None = None, deep: bool = False,
                   io_workers: int = IO_WORKERS) -> dict:
    """Check committed step ``step``'s stored chunks of ``names`` (default: every tensor): a delta's
    own chunks read and checked against their digests, a restart point rebuilt and checked tensor
    by tensor, and with ``deep`` a delta replayed from its restart point. A task: it returns what
    it checked and the errors it found (``chunks``, ``bytes``, ``errors``, ``replayed``), and
    raises nothing for the data's faults."""
    out: dict = {"chunks": 0, "bytes": 0, "errors": [], "replayed": False}
    r = open_root(root)
    try:
        cat = Catalog(r)
        marker = cat.require_marker(step)
        m = cat.manifest(step)
        chosen = sorted(m.tensors if names is None else names)
        restart = m.restart_entries()
        if m.kind == DELTA:  # the delta's own chunks (a keyframe's are read by its rebuild below)
            entries = [m.tensors[n] for n in chosen]
            for _ in stream_chunks(r, ((m, e, pos) for e in entries for pos in range(e.n_stored)), io_workers):
                pass
            out["chunks"] += sum(e.n_stored for e in entries)
            out["bytes"] += sum(e.stored_bytes for e in entries)
        if restart is not None:
            ref = reader.StepRef(step, marker.attempt, marker.manifest_digest)
            plan = reader.RefitPlan(r.ref, step, None, (Move(step, Direction.KEYFRAME),), {step: ref})
            _replay(r, plan, io_workers, chosen)
            out["chunks"] += sum(restart[n].n_stored for n in chosen)
            out["bytes"] += sum(restart[n].stored_bytes for n in chosen)
        if deep and m.kind == DELTA:
            _replay(r, reader.plan_replay(r, step), io_workers, chosen)  # a retracted step too: its data stays until gc
            out["replayed"] = True
    except DCRError as e:
        out["errors"].append(str(e))
    except Exception as e:  # noqa: BLE001 - an unreadable object is a verification failure too
        out["errors"].append(f"step {step}: {type(e).__name__}: {e}")
    return out


class VerifySteps(StepTable):
    verify_tensors = Step(verify_tensors)  # one per step; on workers mapped over groups of its tensors


def _rebuilt_bytes(cat: Catalog, steps: list[int], deep: bool) -> int:
    """The raw bytes ``verify`` rebuilds (restart points, and deltas replayed with ``deep``): its
    progress total. Steps that cannot be read count nothing here; the loop reports them."""
    total = 0
    for s in steps:
        try:
            m = cat.manifest(s)
        except Exception:  # noqa: BLE001 - the verify loop reports it
            continue
        restart = m.restart_entries()
        total += sum(e.nbytes for e in (restart or {}).values())
        if deep and m.kind == DELTA:
            total += sum(e.nbytes for e in m.tensors.values())
    return total


def _check_source(root: Root, cat: Catalog, step: int, report: VerifyReport) -> list[str]:
    """The step's source layout (the published file's headers), read and checked against its
    manifest's digest and tensors; the errors (none when the step has none, or when its manifest
    cannot be read: that is reported already)."""
    try:
        m = cat.manifest(step)
    except Exception:  # noqa: BLE001 - reported by the tensors' check
        return []
    if m.source is None:
        return []
    try:
        source_layout.read(root, m)
    except DCRError as e:
        return [str(e)]
    except Exception as e:  # noqa: BLE001 - an unreadable object is a verification failure too
        return [f"step {step}: {type(e).__name__}: {e}"]
    report.bytes += m.source.nbytes
    return []


def verify(root: Root, step: int | None = None, deep: bool = False, workers: int = IO_WORKERS,
           runner: Runner | None = None, group_bytes: int | None = None) -> VerifyReport:
    """Re-read every stored chunk of the chosen steps and check it against its manifest.

    Restart points (keyframes, and deltas' full snapshots) are rebuilt and checked tensor by tensor.
    With ``deep``, every delta is replayed from its restart point and checked against its tensor
    digests. Streamed: memory is one tensor plus the read window, whatever the model's size.
    ``workers``: objects read at once. With a runner that maps (``flows.workers``), each step's
    tensors are checked as groups of about ``group_bytes`` raw bytes (default:
    ``dcr_core.batches.target_bytes``) on its workers."""
    cat = Catalog(root)
    if step is not None:
        cat.require_marker(step)  # a step that is not committed: that error, as every command says it (not a failed check)
    tasks = VerifySteps(runner or InProcess())
    report = VerifyReport(deep=deep)
    steps = [step] if step is not None else cat.ever_committed_steps()  # retracted steps' data too, until gc
    ref = portable_root(root.ref) if tasks.mapped else root.ref
    if events.listened():  # a progress bar: its total costs reading every manifest first
        events.reached("work.planned", what="verify", nbytes=_rebuilt_bytes(cat, steps, deep))
    for s in steps:
        if tasks.mapped:
            try:
                m = cat.manifest(s)
            except DCRError as e:
                report.errors.append(str(e))
                report.steps.append(s)
                continue
            except Exception as e:  # noqa: BLE001 - as verify_tensors reports it in one process
                report.errors.append(f"step {s}: {type(e).__name__}: {e}")
                report.steps.append(s)
                continue
            runs = batches_for(((n, e.nbytes) for n, e in sorted(m.tensors.items())), tasks.slots, group_bytes)
            parts = tasks.map(verify_tensors, [{"names": tuple(r)} for r in runs], root=ref, step=s, deep=deep,
                              io_workers=workers)
        else:
            parts = [tasks.verify_tensors(ref, s, None, deep, workers)]
        errors: list[str] = []
        for part in parts:
            report.chunks += part["chunks"]
            report.bytes += part["bytes"]
            errors += [e for e in part["errors"] if e not in errors]  # a step-wide fault: once, not per group
        errors += [e for e in _check_source(root, cat, s, report) if e not in errors]
        report.errors += errors
        if parts and all(p["replayed"] for p in parts):
            report.replayed.append(s)
        report.steps.append(s)
    if step is not None and not report.steps:
        raise IntegrityError(f"{root.url}: nothing to verify")
    return report
