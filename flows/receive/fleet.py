"""``dcr fleet ROOT --engine URL ...``: one policy version across a fleet of vLLM servers, all or nothing.

A member is an OpenAI-compatible vLLM server started with ``--weight-transfer-config
'{"backend": "dcr"}'`` and ``VLLM_SERVER_DEV_MODE=1`` (``flows.receive.vllm_transfer``), driven
through vLLM's own weight-transfer routes; a DCR state file (``state:PATH``) or a vLLM ``LLM`` in
this process (``local:NAME``) answers the same calls (``flows.receive.fleet_members``). A switch
to step N (default: the newest live step):

1. **prepare** (every member, at once; they keep serving): ``/init_weight_transfer_engine`` with
   the ROOT, the member's receiver id and ``prepare: N`` (each worker pulls and verifies N into a
   staged mirror), then ``/start_weight_update``, which returns once the step is staged and
   verified, or fails. That call waits inside vLLM's engine loop: a member stops generating from
   then until its pull is done (with a small change, briefly; a non-blocking probe of the prepare
   is not built yet). If any member fails (down, unreachable, a step that does not verify), every
   member that started gets ``/finish_weight_update`` with no update (what it staged is dropped),
   nobody switches, and the switch fails naming the member.
2. **apply** (every member, at once; the pause window): ``/pause`` (vLLM's default mode, ``abort``:
   requests in flight are aborted rather than finished on the new weights, and the KV and prefix
   caches are cleared), ``/update_weights {"step": N}``, ``/finish_weight_update {"weight_version":
   "N"}``, ``/resume`` (always asked; a member left paused counts as failed). A member already
   serving N is not paused. A member whose apply fails puts
   its own engine back (``flows.receive.vllm_worker``); then every member already at N is **taken
   back** to its previous step by the same calls (``update_weights {"step": prev}``: the inverse
   delta, exact) and its version set back: the fleet ends all at N or all where it was.
3. **record**: ``fleets/NAME.json`` (``storage.fleet``) says the version, each member's step and
   outcome; ``dcr status`` shows it.

A coordinator that dies is safe to rerun: a member left with an update open (after phase 1) is
finished without an update first (what it staged is dropped); a member left paused (inside phase
2) serves again once the rerun (or any `/resume`) resumes it.

A member's previous step is what the fleet's record says it served, else its receiver position in
ROOT. A member DCR never refitted (started from a checkpoint directory) has none: if it must be
taken back, the outcome is ``mixed`` and its entry says so. Rerunning the same switch converges:
members already at N do nothing (``current``), a restarted member reloads N whole. Moving back is
the same command with a lower ``--step``; after ``dcr retract``, a switch without ``--step`` moves
the fleet to the newest live step.

Receiver ids: ``NAME-HOST-PORT`` of each member's URL (``NAME-state-FILENAME``, ``NAME-LOCALNAME``;
stable across runs: it names the member's mirror and its position in ROOT), or ``ID=URL`` to
choose one.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import time
import urllib.parse
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

from dcr_core.errors import DCRError, StepNotFoundError, UsageError
from flows.receive.fleet_members import HTTP_TIMEOUT, MemberError, member_call
from flows.steps import InProcess, Runner, Step, StepTable
from storage import fleet, layout
from storage.catalog import Catalog, not_committed
from storage.root import RootRef, open_root

log = logging.getLogger("dcr.fleet")


class FleetSwitchError(DCRError):
    """A fleet did not switch (see the record's outcome); what each member serves is in the record."""

    exit_code = 6

    def __init__(self, message: str, result: FleetResult | None = None):
        super().__init__(message)
        self.result = result


@dataclass(frozen=True)
class MemberRef:
    url: str
    receiver: str


def parse_members(name: str, engines: list[str]) -> list[MemberRef]:
    """``URL`` or ``ID=URL`` per engine -> members with their receiver ids (see the module docstring).
    A URL is ``http(s)://HOST:PORT``, ``state:PATH`` or ``local:NAME`` (``flows.receive.fleet_members``)."""
    if not engines:
        raise UsageError("a fleet needs at least one --engine URL")
    out = []
    for spec in engines:
        rid, sep, url = spec.partition("=")
        if not sep or "://" in rid or rid in ("state", "local") or rid.startswith(("state:", "local:")):
            rid, url = "", spec
        if url.startswith("state:") and len(url) > len("state:"):
            url = "state:" + os.path.abspath(url[len("state:"):])  # the same file from any directory
            default = f"{name}-state-{os.path.basename(url)}"
        elif url.startswith("local:") and len(url) > len("local:"):
            default = f"{name}-{url[len('local:'):]}"
        else:
            u = urllib.parse.urlparse(url)
            if u.scheme not in ("http", "https") or not u.hostname:
                raise UsageError(f"--engine {spec!r}: expected http://HOST:PORT, state:PATH or local:NAME "
                                 "(each optionally ID=...)")
            url = url.rstrip("/")
            default = f"{name}-{u.hostname}-{u.port or 80}"
        rid = rid or re.sub(r"[^A-Za-z0-9._-]", "-", default)
        out.append(MemberRef(url, layout.check_receiver(rid)))
    if len({m.url for m in out}) != len(out) or len({m.receiver for m in out}) != len(out):
        raise UsageError("every --engine must be a different member with a different receiver id")
    return out


@dataclass
class FleetResult:
    fleet: str
    outcome: str
    version: int | None
    target: int
    previous: int | None
    members: list[dict] = field(default_factory=list)
    seconds: float = 0.0


def _each(members: list[dict], fn) -> list:
    """``fn(member)`` for every member at once; results (or the exception) in order."""
    def guarded(m):
        try:
            return fn(m)
        except Exception as e:  # noqa: BLE001 - each member's failure is reported, not raised here
            return e

    with ThreadPoolExecutor(max_workers=max(1, len(members))) as pool:
        return list(pool.map(guarded, members))


def _error(e: BaseException) -> str:
    return str(e) if isinstance(e, MemberError) else f"{type(e).__name__}: {e}"


# -- the steps (Prefect tasks under fleet_refit) --------------------------------------------------


def resolve_fleet(root: RootRef, name: str, members: list[dict], step: int | None) -> dict:
    """The step to switch to (``step``, checked live; default the newest live step) and each
    member's previous step: the fleet's record, else its receiver position in ROOT, and only if the
    member's weight version (``/weight_info``) says it serves that step (a member restarted from its
    checkpoint directory reports vLLM's default: its step is unknown)."""
    r = open_root(root)
    cat = Catalog(r)
    if step is None:
        target = cat.latest_committed()
        if target is None:
            raise not_committed(r, "no committed step to switch the fleet to")
    else:
        target = layout.check_step(step)
        if not cat.is_live(target):
            if cat.retraction(target) is None:
                raise not_committed(r, f"step {target} is not committed; a fleet switches only to a live step")
            raise StepNotFoundError(f"{r.url}: step {target} is retracted; a fleet switches only to a live step")
    held = fleet.read(r, name)
    by_receiver = {m.receiver: m.step for m in held.members} if held else {}
    versions = _each(members, lambda m: member_call(m["url"], "/weight_info", method="GET", timeout=30)["weight_version"])
    out = []
    for m, version in zip(members, versions):
        prev = by_receiver.get(m["receiver"])
        if prev is None:
            pos = cat.position(m["receiver"])
            prev = pos.get("step") if pos else None
        out.append({**m, "previous": prev if prev is not None and version == str(prev) else None})
    return {"target": target, "previous": held.version if held else None, "members": out}


def prepare_members(root: RootRef, members: list[dict], target: int, timeout: float = HTTP_TIMEOUT) -> list[dict]:
    """Phase 1 on every member at once (they keep serving); each result says ``ok`` or the error."""
    def prepare(m):
        server = m["url"].startswith(("http://", "https://"))
        init = {"root": root.url, "receiver_id": m["receiver"], "storage_options": dict(root.storage_options),
                "prepare": True, "step": target, **({"prepare_id": uuid.uuid4().hex} if server else {})}
        for attempt in (1, 2):
            member_call(m["url"], "/init_weight_transfer_engine", {"init_info": init}, timeout=timeout)
            if server:  # while it pulls, the server serves: wait for its report, not in its engine loop
                await_prepared(root, m, init["prepare_id"], timeout)
            try:
                member_call(m["url"], "/start_weight_update", timeout=timeout)  # returns once staged and verified
                return True
            except MemberError as e:
                if e.status is None or attempt == 2:
                    raise
            # vLLM refuses a start while an update is open: a coordinator that died after its prepare
            # left one. Finishing it without an update drops what it held; then prepare again, once.
            with contextlib.suppress(MemberError):
                member_call(m["url"], "/finish_weight_update", {}, timeout=timeout)
        return True

    results = _each(members, prepare)
    return [{**m, "ok": r is True, **({} if r is True else {"error": _error(r)})} for m, r in zip(members, results)]


def await_prepared(root: RootRef, m: dict, prepare_id: str, timeout: float, poll: float = 0.02) -> bool:
    """Wait until every worker of member ``m`` reported the prepare ``prepare_id`` done
    (``prepared/<receiver>.json``, one per TP rank as ``<receiver>-rankK``); raise ``MemberError``
    with what one reported failing. False when no report came within ``timeout`` (a member whose
    DCR does not report: the start call then waits for the prepare, in its engine loop)."""
    cat = Catalog(open_root(root))
    rid = m["receiver"]
    deadline = time.monotonic() + timeout
    while True:
        docs = [d for d in (cat.prepared(rid),) if d and d.get("prepare_id") == prepare_id]
        if not docs:
            first = cat.prepared(f"{rid}-rank0")
            if first and first.get("prepare_id") == prepare_id:
                ranks = first.get("ranks") if isinstance(first.get("ranks"), int) else 1
                docs = [first] + [cat.prepared(f"{rid}-rank{k}") for k in range(1, ranks)]
                docs = [d for d in docs if d and d.get("prepare_id") == prepare_id]
                if len(docs) < ranks:
                    docs = [d for d in docs if not d.get("ok")]  # a failure is enough to stop waiting
        failed = [d for d in docs if not d.get("ok")]
        if failed:
            raise MemberError(f"{m['url']}: preparing step {failed[0].get('step')} failed: {failed[0].get('error')}", 500)
        if docs:
            return True
        if time.monotonic() > deadline:
            log.warning("%s: no prepare report within %.0f s; its start call waits for the prepare", m["url"], timeout)
            return False
        time.sleep(poll)
        poll = min(poll * 1.5, 0.5)


def drop_prepared(members: list[dict], timeout: float = HTTP_TIMEOUT) -> list[dict]:
    """Nobody switches: every member gets ``/finish_weight_update`` with no update (what it staged
    is dropped; a member whose start failed or timed out here may still have opened one), errors
    ignored."""
    _each(members, lambda m: member_call(m["url"], "/finish_weight_update", {}, timeout=timeout))
    return members


class SwitchFailed(MemberError):
    """A member's pause window failed; ``applied``: its weights had reached the step (the update
    returned) before the failure, so it must be taken back like a member that switched."""

    def __init__(self, error: MemberError, applied: bool):
        super().__init__(str(error), error.status)
        self.applied = applied


def _switch(m: dict, step: int, timeout: float, start: bool) -> dict:
    """The pause window of one member: pause, update to ``step``, finish with the version, resume.
    The update session is always closed (finished without an update if the update never ran), and
    the member always asked to resume; any failure raises ``SwitchFailed`` saying whether the
    weights had changed."""
    url = m["url"]
    if start:
        member_call(url, "/start_weight_update", timeout=timeout)
    t0 = time.perf_counter()
    applied, error = False, None
    try:
        member_call(url, "/pause", timeout=timeout)
        member_call(url, "/update_weights", {"update_info": {"step": step}}, timeout=timeout)
        applied = True
        member_call(url, "/finish_weight_update", {"weight_version": str(step)}, timeout=timeout)
    except MemberError as e:
        error = e
        if not applied:  # a session still open (a failed pause) is closed; after a failed update vLLM closed it
            with contextlib.suppress(MemberError):
                member_call(url, "/finish_weight_update", {}, timeout=timeout)
    try:
        member_call(url, "/resume", timeout=timeout)
    except MemberError as e:  # a member left paused is a failure too (the first error is the one reported)
        error = error or e
    if error is not None:
        raise SwitchFailed(error, applied)
    return {"pause_seconds": time.perf_counter() - t0}


def apply_members(members: list[dict], target: int, timeout: float = HTTP_TIMEOUT) -> list[dict]:
    """Phase 2 on every member at once; each result says ``ok`` (with its pause) or the error. A
    member already serving ``target`` is not paused: its open update is finished without one."""
    def apply(m):
        if m["previous"] == target:
            member_call(m["url"], "/finish_weight_update", {}, timeout=timeout)
            return {"pause_seconds": 0.0}
        return _switch(m, target, timeout, start=False)

    results = _each(members, apply)
    return [{**m, "ok": isinstance(r, dict), **(r if isinstance(r, dict) else {
        "error": _error(r), "answered": getattr(r, "status", None) is not None,
        "applied": getattr(r, "applied", False)})} for m, r in zip(members, results)]


def take_back_members(members: list[dict], timeout: float = HTTP_TIMEOUT) -> list[dict]:
    """Members that applied go back to their previous step (the inverse delta, exact), at once;
    a member with no previous step cannot be taken back (its result says so)."""
    def back(m):
        if m.get("previous") is None:
            raise UsageError(f"{m['url']}: its previous step is unknown (DCR never refitted it); it stays at the new step")
        return _switch(m, m["previous"], timeout, start=True)

    results = _each(members, back)
    return [{**m, "back": isinstance(r, dict), **({} if isinstance(r, dict) else {"back_error": _error(r)})}
            for m, r in zip(members, results)]


def record_fleet(root: RootRef, name: str, target: int, previous: int | None, outcome: str,
                 members: list[dict]) -> dict:
    """Write ``fleets/NAME.json``; the record as written."""
    entries = []
    for m in members:
        entries.append(fleet.Member(url=m["url"], receiver=m["receiver"], step=m.get("step"), outcome=m["outcome"],
                                    error=m.get("error"), pause_seconds=m.get("pause_seconds", 0.0)))
    steps = {e.step for e in entries}
    version = steps.pop() if len(steps) == 1 else None
    rec = fleet.record(open_root(root), fleet.FleetRecord(fleet=name, version=version, target=target,
                                                          previous=previous, outcome=outcome, members=entries, at=0.0))
    return rec.model_dump()


FLEET_STEPS = StepTable(
    Step("resolve-fleet", resolve_fleet),
    Step("prepare-members", prepare_members),
    Step("drop-prepared", drop_prepared),
    Step("apply-members", apply_members),
    Step("take-back-members", take_back_members),
    Step("record-fleet", record_fleet),
)


def run_fleet(root: str | os.PathLike, engines: list[str], step: int | None = None, name: str = "default",
              storage_options: dict | None = None, runner: Runner | None = None,
              timeout: float = HTTP_TIMEOUT) -> FleetResult:
    """Switch every engine of fleet ``name`` to ``step`` (default: the newest live step) of
    ``root``, all or nothing (see the module docstring). Raises ``FleetSwitchError`` (after writing
    the record) unless every member serves the target step."""
    layout.fleet_key(name)
    ref = RootRef(os.fspath(root), dict(storage_options or {}))
    members = [asdict(m) for m in parse_members(name, list(engines))]
    tasks = FLEET_STEPS.bind(runner or InProcess())
    t0 = time.perf_counter()
    plan = tasks.resolve_fleet(ref, name, members, step)
    target, previous, members = plan["target"], plan["previous"], plan["members"]
    prepared = tasks.prepare_members(ref, members, target, timeout)
    failed = [m for m in prepared if not m["ok"]]
    if failed:
        tasks.drop_prepared(prepared, timeout)
        done = [{**m, "step": m["previous"], "outcome": "not-switched" if m["ok"] else "failed"} for m in prepared]
        return _finish(tasks, ref, name, target, previous, "aborted", done, t0,
                       f"nobody switched: {failed[0]['url']} could not prepare step {target} ({failed[0]['error']})")
    applied = tasks.apply_members(members, target, timeout)
    failed = [m for m in applied if not m["ok"]]
    if not failed:
        done = [{**m, "step": target, "outcome": "unchanged" if m["previous"] == target else "switched"} for m in applied]
        return _finish(tasks, ref, name, target, previous, "unchanged" if previous == target and all(
            d["outcome"] == "unchanged" for d in done) else "switched", done, t0, None)
    switched = [m for m in applied if (m["ok"] or m.get("applied")) and m["previous"] != target]
    back = tasks.take_back_members(switched, timeout)
    back_by = {m["receiver"]: m for m in back}
    done = []
    for m in applied:
        if m["receiver"] in back_by:
            b = back_by[m["receiver"]]
            done.append({**m, "step": m["previous"], "outcome": "taken-back"} if b["back"] else
                        {**m, "step": target, "outcome": "switched" if m["ok"] else "failed",
                         "error": b["back_error"]})
        elif m["ok"]:
            done.append({**m, "step": target, "outcome": "unchanged"})
        else:  # its engine put itself back, unless it is gone or says it must be reloaded
            lost = not m["answered"] or "must be reloaded" in m["error"] or m.get("applied")
            done.append({**m, "step": None if lost else m["previous"], "outcome": "failed"})
    steps = {d["step"] for d in done}
    mixed = len(steps) != 1 or None in steps  # the members are not all on one known step
    why = f"{failed[0]['url']} failed to apply step {target} ({failed[0]['error']})"
    return _finish(tasks, ref, name, target, previous, "mixed" if mixed else "taken-back", done, t0,
                   why + ("; the members are not all on one step now (see the fleet record)" if mixed
                          else "; every member was taken back to its previous step"))


def _finish(tasks, ref: RootRef, name: str, target: int, previous: int | None, outcome: str, members: list[dict],
            t0: float, error: str | None) -> FleetResult:
    rec = tasks.record_fleet(ref, name, target, previous, outcome, members)
    result = FleetResult(name, outcome, rec["version"], target, previous, rec["members"], time.perf_counter() - t0)
    if error is not None:
        raise FleetSwitchError(f"fleet {name}: {error}", result)
    return result
