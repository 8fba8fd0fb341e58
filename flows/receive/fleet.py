"""``dcr fleet ROOT --engine URL ...``: one policy version across a fleet of vLLM servers, all or nothing.

A member is a receiver of any kind named by a URL (``flows.receive.receiver``, its registry): an
OpenAI-compatible vLLM server started with ``--weight-transfer-config '{"backend": "dcr"}'`` and
``VLLM_SERVER_DEV_MODE=1`` (``flows.receive.vllm_transfer``), driven through vLLM's own
weight-transfer routes (``http://HOST:PORT``), a vLLM ``LLM`` in this process (``local:NAME``;
both ``flows.receive.fleet_members``), or a DCR state file (``state:PATH``,
``flows.receive.pipeline.StateFile``). The coordinator drives each through the receivers'
lifecycle (``bind``, ``prepare``, ``pause``, ``apply``, ``record``, ``resume``, ``release``); the
calls below are what a server member gets. A switch to step N (default: the newest live step):

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

Before anything is read or changed, a member named twice (a state file by two paths, a link and
its target) is refused, and so is a server member that would be sent a credential: a server opens
ROOT with the credentials of its own environment (``storage.credentials``: the rule; a local ROOT
is sent as an absolute path, which must name the same directory on the server's machine). Then
what each member holds alone for the switch (a state file's lock, until its apply is over) is
taken one member at a time in the order of their identities (``Receiver.identity``: a state file's
real path), the same order in every coordinator: two switches over the same state files wait for
each other, never in a cycle. ``timeout`` bounds every wait: all the holds together, and each
member's answer.

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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import cast

from dcr_core import events
from dcr_core.errors import BusyError, DCRError, StepNotFoundError, UsageError
from flows import local_refs
from flows.receive import receiver as receivers
from flows.receive.fleet_members import HTTP_TIMEOUT, MemberError
from flows.receive.receiver import Binding, Receiver
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
    A URL names a receiver kind by its scheme (``flows.receive.receiver``): ``http(s)://HOST:PORT``,
    ``state:PATH`` or ``local:NAME``."""
    if not engines:
        raise UsageError("a fleet needs at least one --engine URL")
    out = []
    for spec in engines:
        rid, sep, url = spec.partition("=")
        schemes = receivers.url_schemes()
        if not sep or "://" in rid or rid.lower() in schemes or receivers.scheme_of(rid) in schemes:
            rid, url = "", spec  # a URL holding "=" (state:a=b.safetensors, ?x=y), not ID=URL
        try:
            url, suffix = receivers.kind_of_url(url).load().canonical(url)
        except UsageError:
            raise UsageError(f"--engine {spec!r}: expected {receivers.url_forms()} (each optionally ID=...)") from None
        rid = rid or re.sub(r"[^A-Za-z0-9._-]", "-", f"{name}-{suffix}")
        out.append(MemberRef(url, layout.check_receiver(rid)))
    for what in ("url", "receiver"):
        seen = [getattr(m, what) for m in out]
        twice = next((v for i, v in enumerate(seen) if v in seen[:i]), None)
        if twice is not None:
            raise UsageError(f"--engine: {twice} named twice; every --engine must be a different member with a "
                             "different receiver id")
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


def _status(e: BaseException) -> int | None:
    """What the member answered: an HTTP status (None: no answer); a member of this process that
    raised answered, as a server's 500."""
    return e.status if isinstance(e, MemberError) else 500


def _receiver(m: dict) -> Receiver:
    """The member's receiver, opened by ``run_fleet`` for the switch (a ``LocalRef``)."""
    return cast(Receiver, local_refs.get(m["ref"]))


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
    versions = _each(members, lambda m: _receiver(m).version())
    out = []
    for m, version in zip(members, versions):
        prev = by_receiver.get(m["receiver"])
        if prev is None:
            pos = cat.position(m["receiver"])
            prev = pos.get("step") if pos else None
        out.append({**m, "previous": prev if prev is not None and version == prev else None})
    return {"target": target, "previous": held.version if held else None, "members": out}


def prepare_members(root: RootRef, name: str, members: list[dict], target: int) -> list[dict]:
    """Phase 1 on every member at once (they keep serving): each bound to ROOT under its receiver
    id, then prepared; each result says ``ok`` or the error."""
    def prepare(m):
        r = _receiver(m)
        r.bind(Binding(root, m["receiver"], coordinator=name))
        r.prepare(target)  # returns once staged and verified
        return True

    results = _each(members, prepare)
    return [{**m, "ok": r is True, **({} if r is True else {"error": _error(r)})} for m, r in zip(members, results)]


def drop_prepared(members: list[dict]) -> list[dict]:
    """Nobody switches: every member releases what it prepared (what it staged is dropped; a member
    whose prepare failed or timed out here may still have opened an update), errors ignored."""
    _each(members, lambda m: _receiver(m).release())
    return members


class SwitchFailed(MemberError):
    """A member's pause window failed; ``applied``: its weights had reached the step (the update
    returned) before the failure, so it must be taken back like a member that switched."""

    def __init__(self, error: BaseException, applied: bool):
        super().__init__(_error(error), _status(error))
        self.applied = applied


def _switch(m: dict, step: int) -> dict:
    """The pause window of one member: pause, apply ``step``, record it (a server: finished with the
    version), resume. What it staged is always released (dropped if the update never ran), and the
    member always asked to resume; any failure raises ``SwitchFailed`` saying whether the weights
    had changed."""
    r = _receiver(m)
    t0 = time.perf_counter()
    applied, error = False, None
    try:
        r.pause()
        events.reached("fleet.member-update", member=m["url"], step=step)
        r.apply(step)
        applied = True
        r.record()
    except Exception as e:  # noqa: BLE001 - every member's failure is reported (SwitchFailed)
        error = e
        if not applied:  # an update still open (a failed pause) is closed; after a failed update vLLM closed it
            with contextlib.suppress(Exception):
                r.release()
    try:
        r.resume()
    except Exception as e:  # noqa: BLE001 - a member left paused is a failure too (the first error is the one reported)
        error = error or e
    with contextlib.suppress(Exception):  # leases and locks of a member refitted here
        r.release()
    if error is not None:
        raise SwitchFailed(error, applied)
    return {"pause_seconds": time.perf_counter() - t0}


def apply_members(members: list[dict], target: int) -> list[dict]:
    """Phase 2 on every member at once; each result says ``ok`` (with its pause) or the error. A
    member already serving ``target`` is not paused: what it prepared is released."""
    def apply(m):
        if m["previous"] == target:
            _receiver(m).release()
            return {"pause_seconds": 0.0}
        return _switch(m, target)

    results = _each(members, apply)
    return [{**m, "ok": isinstance(r, dict), **(r if isinstance(r, dict) else {
        "error": _error(r), "answered": _status(r) is not None,
        "applied": getattr(r, "applied", False)})} for m, r in zip(members, results)]


def take_back_members(members: list[dict]) -> list[dict]:
    """Members that applied go back to their previous step (the inverse delta, exact), at once;
    a member with no previous step cannot be taken back (its result says so)."""
    def back(m):
        if m.get("previous") is None:
            raise UsageError(f"{m['url']}: its previous step is unknown (DCR never refitted it); it stays at the new step")
        return _switch(m, m["previous"])

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


class FleetSteps(StepTable):
    """A fleet switch's steps, in order."""

    resolve_fleet = Step(resolve_fleet)
    prepare_members = Step(prepare_members)
    drop_prepared = Step(drop_prepared)  # one failed to prepare: nobody switches
    apply_members = Step(apply_members)
    take_back_members = Step(take_back_members)  # one failed to apply
    record_fleet = Step(record_fleet)


def run_fleet(root: str | os.PathLike, engines: list[str], step: int | None = None, name: str = "default",
              storage_options: dict | None = None, runner: Runner | None = None,
              timeout: float = HTTP_TIMEOUT) -> FleetResult:
    """Switch every engine of fleet ``name`` to ``step`` (default: the newest live step) of
    ``root``, all or nothing (see the module docstring). Raises ``FleetSwitchError`` (after writing
    the record) unless every member serves the target step."""
    layout.fleet_key(name)
    ref = RootRef(os.fspath(root), dict(storage_options or {}))
    parsed = parse_members(name, list(engines))
    tasks = FleetSteps(runner or InProcess())
    with contextlib.ExitStack() as held:  # each member's receiver, for the steps of this switch
        members = [{"url": m.url, "receiver": m.receiver,
                    "ref": held.enter_context(local_refs.holding(receivers.member(m.url, timeout=timeout), "member"))}
                   for m in parsed]
        admit_members(ref, name, members)
        try:
            hold_members(name, members, timeout)
            return _switch_fleet(tasks, ref, name, members, step)
        finally:  # whatever a failure left prepared or locked (nothing, when the switch ran its course)
            _each(members, lambda m: _receiver(m).release())


def admit_members(root: RootRef, name: str, members: list[dict]) -> None:
    """Before anything is read or changed: one target named twice (a state file by two paths, a link
    and its target) is refused, and so is a switch a member would refuse (``Receiver.admit``: a
    server is sent no credentials), each in one line naming the member."""
    seen: dict[str, str] = {}
    for m in members:
        r = _receiver(m)
        first = seen.setdefault(r.identity, m["url"])
        if first != m["url"]:
            raise UsageError(f"--engine {first} and --engine {m['url']} are one member ({r.identity}); name each once")
        r.admit(Binding(root, m["receiver"], coordinator=name))


def hold_members(name: str, members: list[dict], timeout: float) -> None:
    """What each member holds alone for the switch (a state file's lock), taken one member at a time
    in the order of their identities (the one order every coordinator takes them in, whatever order
    its ``--engine`` options came in: two switches over the same members never wait on each other in
    a cycle), all within ``timeout`` (``BusyError`` past it, before anything changed)."""
    deadline = time.monotonic() + timeout
    for m in sorted(members, key=lambda m: _receiver(m).identity):
        events.reached("fleet.member-hold", fleet=name, member=m["url"])
        try:
            _receiver(m).hold(max(0.0, deadline - time.monotonic()))
        except BusyError:
            raise BusyError(f"fleet {name}: nobody switched: {m['url']} is held by another writer (a receive, a "
                            f"materialize or a fleet switch) and did not come free in {timeout:g} s (the timeout)") from None


def _switch_fleet(tasks: FleetSteps, ref: RootRef, name: str, members: list[dict], step: int | None) -> FleetResult:
    t0 = time.perf_counter()
    plan = tasks.resolve_fleet(ref, name, members, step)
    target, previous, members = plan["target"], plan["previous"], plan["members"]
    prepared = tasks.prepare_members(ref, name, members, target)
    failed = [m for m in prepared if not m["ok"]]
    if failed:
        tasks.drop_prepared(prepared)
        done = [{**m, "step": m["previous"], "outcome": "not-switched" if m["ok"] else "failed"} for m in prepared]
        return _finish(tasks, ref, name, target, previous, "aborted", done, t0,
                       f"nobody switched: {failed[0]['url']} could not prepare step {target} ({failed[0]['error']})")
    applied = tasks.apply_members(members, target)
    failed = [m for m in applied if not m["ok"]]
    if not failed:
        done = [{**m, "step": target, "outcome": "unchanged" if m["previous"] == target else "switched"} for m in applied]
        return _finish(tasks, ref, name, target, previous, "unchanged" if previous == target and all(
            d["outcome"] == "unchanged" for d in done) else "switched", done, t0, None)
    switched = [m for m in applied if (m["ok"] or m.get("applied")) and m["previous"] != target]
    back = tasks.take_back_members(switched)
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


def _finish(tasks: FleetSteps, ref: RootRef, name: str, target: int, previous: int | None, outcome: str, members: list[dict],
            t0: float, error: str | None) -> FleetResult:
    rec = tasks.record_fleet(ref, name, target, previous, outcome, members)
    result = FleetResult(name, outcome, rec["version"], target, previous, rec["members"], time.perf_counter() - t0)
    if error is not None:
        raise FleetSwitchError(f"fleet {name}: {error}", result)
    return result
