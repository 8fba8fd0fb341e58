"""``dcr show ROOT --step N`` and ``dcr status ROOT``: one step tensor by tensor, and where each
receiver is and how it got there. Read-only; no torch.

Every field printed is escaped (``dcr_core.text``): receiver records and fleet records are written
by whoever may write ``receivers/`` and ``fleets/``, and a newline in one would forge a row."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from dcr_core.errors import IntegrityError
from dcr_core.text import plural, printable
from flows.maintenance.audit import human_bytes
from storage import layout
from storage.catalog import Catalog, earlier_visits, utc_epoch
from storage.root import Root

log = logging.getLogger("dcr.inspect")


@dataclass
class TensorRow:
    name: str
    dtype: str
    shape: list[int]
    encoding: str
    changed: int
    elements: int
    bytes_full: int
    bytes_stored: int
    chunks_stored: int
    chunks: int
    digest: str
    base_digest: str | None


@dataclass
class StepView:
    step: int
    kind: str
    base_step: int | None
    attempt: str
    policy_digest: str
    committed_at: str
    codec: dict
    summary: dict
    tensors: list[TensorRow] = field(default_factory=list)
    snapshot_bytes: int | None = None
    receivers: list[str] = field(default_factory=list)
    retracted: dict | None = None  # {"retracted_at", "reason"} of a step taken back (dcr retract)
    schema_version: int = 0  # of its manifest (3: packed)
    packs: dict[str, int] = field(default_factory=dict)  # pack objects and their bytes (packed steps)


def show_step(root: Root, step: int) -> StepView:
    cat = Catalog(root)
    marker = cat.require_marker(step)
    m = cat.manifest(step)
    rows = [
        TensorRow(e.name, e.dtype, list(e.shape), e.encoding.value, e.changed, e.numel, e.nbytes, e.stored_bytes,
                  e.n_stored, e.grid.n_chunks, e.digest, e.base_digest)
        for e in m.tensors.values()
    ]
    snapshot = sum(e.stored_bytes for e in m.snapshot.values()) if m.snapshot else None
    retraction = cat.retraction(step)
    return StepView(step, m.kind, m.base_step, marker.attempt, m.policy_digest, marker.committed_at, m.codec.to_dict(),
                    dict(marker.summary), rows, snapshot, cat.receivers(step),
                    None if retraction is None else {"retracted_at": retraction.retracted_at, "reason": retraction.reason},
                    m.schema_version, m.packs())


def format_step(v: StepView, digests: bool = False) -> str:
    s = v.summary
    base = "" if v.base_step is None else f" against step {v.base_step}"
    lines = [
        f"step {v.step}: {v.kind}{base}, committed {printable(v.committed_at)}, attempt {v.attempt}",
        f"policy digest {v.policy_digest}; codec {v.codec}",
        f"manifest schema {v.schema_version}; " + (
            f"chunks in {len(v.packs)} pack{'s' if len(v.packs) != 1 else ''} of {human_bytes(sum(v.packs.values()))}"
            if v.packs else "each stored chunk its own object")
        + (f"; {s.get('tensors') - (len(v.tensors) - s['bundles'])} small tensors in {s['bundles']} "
           f"bundle{'s' if s['bundles'] != 1 else ''} (rows %bundle.*)" if s.get("bundles") else ""),
        f"{s.get('tensors_changed')}/{s.get('tensors')} tensors changed, {s.get('elements_changed', '-')} of "
        f"{s.get('elements', '-')} elements; stored {human_bytes(s.get('bytes_stored'))} of "
        f"{human_bytes(s.get('bytes_full'))}"
        + (f" (+ full snapshot {human_bytes(v.snapshot_bytes)}: a restart point)" if v.snapshot_bytes is not None else ""),
        "",
    ]
    if v.retracted is not None:
        why = f": {printable(v.retracted['reason'])}" if v.retracted["reason"] else ""
        lines.insert(1, f"RETRACTED {printable(v.retracted['retracted_at'])}{why} (no refit's target; receivers that "
                        "hold it move back to the newest live step)")
    names = {t.name: printable(t.name) for t in v.tensors}  # a checkpoint's names, escaped: one row each
    w = max([6, *(len(n) for n in names.values())])
    header = (f"{'TENSOR':<{w}}  {'DTYPE':<8}  {'SHAPE':<16}  {'ENCODING':<10}  {'CHANGED':>12}  {'RATE':>8}  "
              f"{'STORED':>10}  {'FULL':>10}  {'CHUNKS':>9}")
    lines.append(header + ("  DIGEST" if digests else ""))
    for t in v.tensors:
        rate = f"{100 * t.changed / t.elements:.3f}%" if t.elements else "-"
        shape = "x".join(map(str, t.shape)) or "()"
        line = (f"{names[t.name]:<{w}}  {t.dtype:<8}  {shape:<16}  {t.encoding:<10}  {t.changed:>12}  {rate:>8}  "
                f"{human_bytes(t.bytes_stored):>10}  {human_bytes(t.bytes_full):>10}  {f'{t.chunks_stored}/{t.chunks}':>9}")
        lines.append(line + (f"  {t.digest}" if digests else ""))
    lines.append("")
    lines.append("receivers that committed it: " + (", ".join(v.receivers) or "-"))
    return "\n".join(lines)


@dataclass
class ReceiverRow:
    receiver: str
    step: int | None  # None: its record is damaged
    lag: int | None  # committed steps behind the latest (None: ROOT holds no committed step)
    from_step: int | None
    moves: list[str]
    bytes_pulled: int | None
    committed_at: str | None
    step_committed: bool  # False: gc deleted the step it holds (its next refit restarts from a restart point)
    step_retracted: bool = False  # the step it holds was retracted: its next refit moves back
    damaged: str | None = None  # why its record cannot be read (naming the object): no position shown


def _age(stamp: str | None, now: float) -> str:
    if not stamp:
        return "-"
    t = utc_epoch(stamp)
    if t is None:
        return stamp
    sec = max(0, int(now - t))
    for unit, n in (("d", 86400), ("h", 3600), ("m", 60)):
        if sec >= n:
            return f"{sec // n}{unit} ago"
    return f"{sec}s ago"


def receiver_status(root: Root) -> tuple[int | None, list[ReceiverRow]]:
    """The latest committed step, and each receiver's position (lag counted in committed steps)."""
    cat = Catalog(root)
    committed = cat.committed_steps()  # the live steps
    retracted = {s for s in cat.ever_committed_steps() if cat.retraction(s) is not None}
    latest = committed[-1] if committed else None
    rows = []
    for rid, rec in sorted(cat.position_records().items()):
        if isinstance(rec, IntegrityError):
            rows.append(ReceiverRow(rid, None, None, None, [], None, None, False, damaged=str(rec)))
            continue
        step = rec["step"]
        lag = None if latest is None else sum(1 for s in committed if s > step)
        rows.append(ReceiverRow(rid, step, lag, rec.get("from_step"), list(rec.get("moves") or []),
                                rec.get("bytes_pulled"), rec.get("committed_at"), step in committed, step in retracted))
    return latest, rows


def format_status(latest: int | None, rows: list[ReceiverRow], now: float | None = None) -> str:
    now = time.time() if now is None else now
    lines = [f"latest committed step: {'-' if latest is None else latest}"]
    if not rows:
        return "\n".join([*lines, "no receiver has recorded a commit"])
    names = {r.receiver: printable(r.receiver) for r in rows}
    w = max([8, *(len(n) for n in names.values())])
    lines.append(f"{'RECEIVER':<{w}}  {'STEP':>8}  {'LAG':>5}  {'FROM':>8}  {'PULLED':>10}  {'UPDATED':>10}  LAST REFIT")
    for r in rows:
        if r.damaged is not None:
            lines.append(f"{names[r.receiver]:<{w}}  {'?':>8}  {'-':>5}  {'-':>8}  {'-':>10}  {'-':>10}  "
                         f"damaged record: {printable(r.damaged)}")
            continue
        held = f"{r.step}" + ("" if r.step_committed else "!" if r.step_retracted else "*")
        lines.append(
            f"{names[r.receiver]:<{w}}  {held:>8}  {'-' if r.lag is None else r.lag:>5}  "
            f"{'-' if r.from_step is None else r.from_step:>8}  {human_bytes(r.bytes_pulled):>10}  "
            f"{printable(_age(r.committed_at, now)):>10}  {_moves(r.moves)}"
        )
    if any(r.step_retracted for r in rows):
        lines.append("! retracted (dcr retract): the receiver's next refit moves it back to the newest live step")
    if any(not r.step_committed and not r.step_retracted and r.damaged is None for r in rows):
        lines.append("* no longer committed (deleted by gc): the receiver's next refit restarts from a restart point")
    return "\n".join(lines)


def _moves(moves: list[str] | None) -> str:
    return printable(", ".join(moves or [])) or "no move"


def format_fleets(records: list, switching: dict | None = None, now: float | None = None) -> str:
    """Each fleet's record (``storage.fleet``): its version (``mixed`` only when members serve
    different steps; ``unknown`` when not every member's step is known), the last switch's outcome
    and target, when it was recorded and how long ago; then each member's step as it said after
    the switch, and a coordinator switching the fleet now (``switching``: its lease, by fleet)."""
    now = time.time() if now is None else now
    switching = switching or {}
    lines = []
    for name in sorted(set(switching) - {r.fleet for r in records}):
        lines.append(printable(f"fleet {name}: no switch recorded yet"))
        lines.append(_switching(switching[name]))
    for r in records:
        version = r.version if r.version is not None else "mixed" if r.outcome == "mixed" else "unknown"
        epoch = "" if r.epoch is None else f", epoch {r.epoch}"
        lines.append(printable(f"fleet {r.fleet}: version {version} ({r.outcome}, target {r.target}{epoch}; "
                               f"recorded {r.at_utc}, {_age(r.at_utc, now)})"))
        for m in r.members:
            err = f": {m.error}" if m.error else ""
            lines.append(printable(f"  {m.receiver} ({m.url}): step {'unknown' if m.step is None else m.step}, "
                                   f"{m.outcome}{err}"))
        if r.fleet in switching:
            lines.append(_switching(switching[r.fleet]))
    return "\n".join(lines)


def _switching(lease) -> str:
    return printable(f"  switching now: {lease.holder.describe()}, epoch {lease.epoch}, its lease until "
                     f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime(lease.expires_at))}")


def histories(root: Root, only: str | None = None, damaged: bool = False) -> dict[str, list[dict]]:
    """Every refit each receiver (or ``only`` this one) recorded on steps ROOT still holds, oldest
    first: how it got where it is. A step the receiver reached more than once gives one entry per
    visit (its record keeps the earlier ones). One listing per step, one read per record. A damaged
    record is said and left out, or with ``damaged`` is an entry ``{"step", "damaged"}`` (naming it)."""
    cat = Catalog(root)
    out: dict[str, list[dict]] = {}
    for step in cat.listed_steps():
        for rid in cat.receivers(step):
            if only is not None and rid != only:
                continue
            rec = cat.checked_receiver_record(layout.receiver_key(step, rid))
            if isinstance(rec, IntegrityError):
                if damaged:
                    out.setdefault(rid, []).append({"step": step, "damaged": str(rec)})
                else:
                    log.warning("%s", rec)
                continue
            if rec is not None:
                latest = {k: v for k, v in rec.items() if k != "earlier"}
                out.setdefault(rid, []).extend([*earlier_visits(rec), latest])
    return {rid: sorted(recs, key=_when) for rid, recs in out.items()}


def _when(record: dict) -> tuple:
    stamp = record.get("committed_at")
    return utc_epoch(stamp) or 0.0, str(stamp or ""), record["step"]


def receiver_history(root: Root, receiver_id: str) -> list[dict]:
    return histories(root, receiver_id, damaged=True).get(receiver_id, [])


def format_history(receiver_id: str, records: list[dict]) -> str:
    if not records:
        return f"receiver {receiver_id}: no record on any step ROOT holds"
    lines = [f"receiver {receiver_id}: {plural(len(records), 'refit')} recorded on steps ROOT still holds (oldest first)",
             f"{'WHEN':<24}  {'FROM':>8}  {'TO':>8}  {'PULLED':>10}  MOVES"]
    for r in records:
        if "damaged" in r:
            lines.append(f"{'?':<24}  {'-':>8}  {r['step']:>8}  {'-':>10}  damaged record: {printable(r['damaged'])}")
            continue
        lines.append(f"{printable(r.get('committed_at', '-')):<24}  {'-' if r.get('from_step') is None else r['from_step']:>8}  {r['step']:>8}  "
                     f"{human_bytes(r.get('bytes_pulled')):>10}  {_moves(r.get('moves'))}")
    return "\n".join(lines)
