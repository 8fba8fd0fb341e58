"""``dcr fleet ROOT --engine URL ...``: one policy version across a fleet of vLLM servers, all or nothing.

A member is a receiver of any kind named by a URL (``flows.receive.receiver``, its registry): an
OpenAI-compatible vLLM server started with ``--weight-transfer-config '{"backend": "dcr"}'`` and
``VLLM_SERVER_DEV_MODE=1`` (``flows.receive.vllm_transfer``), driven through vLLM's own
weight-transfer routes (``http://HOST:PORT``), a vLLM ``LLM`` in this process (``local:NAME``;
both ``flows.receive.fleet_members``), or a DCR state file (``state:PATH``,
``flows.receive.pipeline.StateFile``). The coordinator drives each through the receivers'
lifecycle (``bind``, ``prepare``, ``pause``, ``apply``, ``record``, ``resume``, ``release``); the
calls below are what a server member gets. A switch to step N (default: the newest live step):

One coordinator per fleet at a time: before anything in ROOT is written, the coordinator takes the
fleet's lease (``storage.fleet_lease``: ``fleets/NAME/lease/<epoch>.json``, created only if absent,
renewed from a thread and between the phases, released at the end). Another coordinator holding
it means ``BusyError`` in one line naming it and when its lease ends, or a wait of up to ``wait``
seconds (``--wait``); one that died is taken over after its lease expired (at once when it ran on
this machine and its process is gone). Every switch carries its lease's **epoch**, a number that
only grows; every member keeps the highest epoch it has seen for the fleet and refuses older ones
(``Receiver.admit``, on every request that changes it: bind, prepare, apply), so a coordinator
that lost its lease (paused past its expiry, partitioned) can no longer move a member once a newer
one reached it. A coordinator that finds its lease lost between two phases stops there.

A switch to step N (default: the newest live step):

1. **prepare** (every member, at once; they keep serving): ``/init_weight_transfer_engine`` with
   the ROOT, the member's receiver id, the fleet and epoch, and ``prepare: N`` (each worker pulls
   and verifies N into a staged mirror), then ``/start_weight_update``, which returns once the step
   is staged and verified, or fails. That call waits inside vLLM's engine loop: a member stops
   generating from then until its pull is done (with a small change, briefly; a non-blocking probe
   of the prepare is not built yet). If any member fails (down, unreachable, a step that does not
   verify), every member that started gets ``/finish_weight_update`` with no update (what it
   staged is dropped), nobody switches, and the switch fails naming the member.
2. **apply** (every member, at once; the pause window). First the record says the switch is under
   way (``switching``: no version, the members' steps unknown; not when every member already
   serves N), so that it never names a step a member has left, whenever this coordinator dies.
   Then the step is checked live once more (a step retracted while the members prepared it: nobody
   switches, ``aborted``), then ``/pause`` (vLLM's default mode, ``abort``:
   requests in flight are aborted rather than finished on the new weights, and the KV and prefix
   caches are cleared), ``/update_weights {"step": N, "fleet": NAME, "epoch": E}``,
   ``/finish_weight_update {"weight_version": "N"}``, ``/resume`` (always asked; a member left
   paused counts as failed). A member already serving N is not paused. A member whose apply fails
   puts its own engine back (``flows.receive.vllm_worker``); then every member already at N is
   **taken back** to its previous step by the same calls (``update_weights {"step": prev}``: the
   inverse delta, exact) and its version set back: the fleet ends all at N or all where it was.
3. **read back**: every member is asked which step it serves (``/weight_info``; a state file's
   header); a member that does not answer is unknown, and so is one whose answer this switch cannot
   vouch for (``Receiver.vouched``; vLLM's version lags the weights until a finish names it, and any
   finish sets it: ``flows.receive.fleet_members``), or whose version disagreed with its own record
   in ROOT before the switch and was not set by it (``doubted``). A member not vouched for gets the
   step in phase 2 even where it says it has it.
4. **record**: ``fleets/NAME.json`` (``storage.fleet``) says what the members said: each member's
   step and outcome, the version every member serves (None unless they all serve one known step),
   ``mixed`` only when members serve different steps; written only if no newer epoch wrote one;
   ``dcr status`` shows it. The command succeeds only when every member said it serves N.

A coordinator that dies is safe to rerun: a member left with an update open (after phase 1) is
finished without an update first (what it staged is dropped); a member left paused (inside phase
2) serves again once the rerun (or any `/resume`) resumes it; the rerun's record is read back from
the members, whatever the dead one left.

Before anything is read or changed, a member named twice (a state file by two paths, a link and
its target) is refused, and so is a server member that would be sent a credential: a server opens
ROOT with the credentials of its own environment (``storage.credentials``: the rule; a local ROOT
is sent as an absolute path, which must name the same directory on the server's machine). Then
what each member holds alone for the switch (a state file's lock, until its apply is over) is
taken one member at a time in the order of their identities (``Receiver.identity``: a state file's
real path), the same order in every coordinator: two switches over the same state files wait for
each other, never in a cycle. ``timeout`` bounds every wait but the lease's: all the holds
together, and each member's answer.

A member's previous step is what the fleet's record says it served, else its receiver position in
ROOT. A member DCR never refitted (started from a checkpoint directory) has none: if it must be
taken back, it stays at N and the record says so (``mixed``). Rerunning the same switch converges:
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
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import cast

from dcr_core import events
from dcr_core.clock import SYSTEM, Clock
from dcr_core.errors import BusyError, DCRError, FencedError, StepNotFoundError, UsageError
from flows import local_refs
from flows.receive import receiver as receivers
from flows.receive.fleet_members import HTTP_TIMEOUT, MemberError
from flows.receive.receiver import Binding, Receiver
from flows.steps import InProcess, Runner, Step, StepTable
from storage import fleet, fleet_lease, layout
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


def target_step(root: RootRef, step: int | None) -> int:
    """The step a switch goes to: ``step`` if it is live, else the newest live step; a one-line
    error naming ROOT otherwise (missing, never published, the step not committed or retracted)."""
    r = open_root(root)
    cat = Catalog(r)
    if step is None:
        target = cat.latest_committed()
        if target is None:
            raise not_committed(r, "no committed step to switch the fleet to")
        return target
    target = layout.check_step(step)
    if not cat.is_live(target):
        if cat.retraction(target) is None:
            raise not_committed(r, f"step {target} is not committed; a fleet switches only to a live step")
        raise StepNotFoundError(f"{r.url}: step {target} is retracted; a fleet switches only to a live step")
    return target


def resolve_fleet(root: RootRef, name: str, members: list[dict], step: int | None) -> dict:
    """The step to switch to (``step``, checked live; default the newest live step) and each
    member's previous step: the fleet's record, else its receiver position in ROOT, and only if the
    member's weight version (``/weight_info``) says it serves that step (a member restarted from its
    checkpoint directory reports vLLM's default: its step is unknown)."""
    r = open_root(root)
    cat = Catalog(r)
    target = target_step(root, step)
    held = fleet.read(r, name)
    by_receiver = {m.receiver: m.step for m in held.members} if held else {}
    versions = _each(members, lambda m: _receiver(m).version())
    out = []
    for m, version in zip(members, versions):
        prev = by_receiver.get(m["receiver"])
        if prev is None:
            pos = cat.position(m["receiver"])
            prev = pos.get("step") if pos else None
        # a version that disagrees with what was recorded of it: an update whose finish never came (its
        # coordinator died, or another finish ended its session) left the version behind the weights
        doubted = isinstance(version, int) and prev is not None and version != prev
        out.append({**m, "previous": prev if prev is not None and version == prev else None,
                    **({"doubted": version} if doubted else {})})
    return {"target": target, "previous": held.version if held else None, "members": out}


def prepare_members(root: RootRef, name: str, members: list[dict], target: int, epoch: int) -> list[dict]:
    """Phase 1 on every member at once (they keep serving): each bound to ROOT under its receiver
    id and the coordinator's ``epoch`` (a member that has seen a newer one refuses), then prepared;
    each result says ``ok`` or the error."""
    def prepare(m):
        r = _receiver(m)
        r.bind(Binding(root, m["receiver"], coordinator=name, epoch=epoch))
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
    return {"pause_seconds": time.perf_counter() - t0, "bytes_pulled": r.bytes_pulled()}


def _unchanged(m: dict, target: int) -> bool:
    """A member this switch leaves alone: it serves ``target`` already, and can be believed
    (``Receiver.vouched``: a member whose version may lag its weights gets the step again)."""
    return m["previous"] == target and _receiver(m).vouched


def apply_members(members: list[dict], target: int) -> list[dict]:
    """Phase 2 on every member at once; each result says ``ok`` (with its pause) or the error. A
    member already serving ``target`` is not paused: what it prepared is released."""
    def apply(m):
        if _unchanged(m, target):
            r = _receiver(m)
            r.release()
            return {"pause_seconds": 0.0, "bytes_pulled": r.bytes_pulled()}
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


def read_back_members(members: list[dict]) -> list[dict]:
    """After the switch, every member asked at once which step it serves (``Receiver.version``):
    its entry's ``step`` is what it says (None: no answer, or a version DCR did not set), except a
    member the switch lost track of (``lost``: gone, or its engine must be reloaded), and a member
    whose version disagreed with its recorded step before the switch (``doubted``, by
    ``resolve_fleet``) and that this switch did not set, which are unknown whatever they say."""
    def ask(m):
        return None if m.get("lost") else _receiver(m).version()

    out = []
    for m, said in zip(members, _each(members, ask)):
        if isinstance(said, BaseException):
            out.append({**m, "step": None, "error": m.get("error") or f"asked its version after the switch: {_error(said)}"})
        elif "doubted" in m and m["outcome"] not in ("switched", "taken-back") and said == m["doubted"]:
            out.append({**m, "step": None, "error": m.get("error") or (
                f"says step {said}, which disagrees with its last recorded refit: unknown until a switch sets it")})
        else:
            out.append({**m, "step": said})
    return out


def record_fleet(root: RootRef, name: str, target: int, previous: int | None, outcome: str, members: list[dict],
                 epoch: int, coordinator: str, at: float) -> dict:
    """Write the fleet's record (``storage.fleet``: conditional on ``epoch``) from what the members
    said (``read_back_members``): its outcome and version are theirs; the record as written."""
    entries = [fleet.Member(url=m["url"], receiver=m["receiver"], step=m.get("step"), outcome=m["outcome"],
                            error=m.get("error"), pause_seconds=m.get("pause_seconds", 0.0),
                            bytes_pulled=m.get("bytes_pulled")) for m in members]
    steps = [e.step for e in entries]
    rec = fleet.FleetRecord(fleet=name, version=fleet.version_of(steps), target=target, previous=previous,
                            outcome=fleet.served_outcome(cast(fleet.Outcome, outcome), target, steps), members=entries,
                            at=at, epoch=epoch, coordinator=coordinator)
    return fleet.record(open_root(root), rec).model_dump()


class FleetSteps(StepTable):
    """A fleet switch's steps, in order."""

    resolve_fleet = Step(resolve_fleet)
    prepare_members = Step(prepare_members)
    drop_prepared = Step(drop_prepared)  # one failed to prepare: nobody switches
    apply_members = Step(apply_members)
    take_back_members = Step(take_back_members)  # one failed to apply
    read_back_members = Step(read_back_members)
    record_fleet = Step(record_fleet)


def run_fleet(root: str | os.PathLike, engines: list[str], step: int | None = None, name: str = "default",
              storage_options: dict | None = None, runner: Runner | None = None,
              timeout: float = HTTP_TIMEOUT, wait: float = 0.0, *, lease_seconds: float = fleet_lease.DEFAULT_TTL,
              clock: Clock = SYSTEM, connect: Callable[[str], Receiver] | None = None,
              renew_in_background: bool = True, holder: fleet_lease.Holder | None = None) -> FleetResult:
    """Switch every engine of fleet ``name`` to ``step`` (default: the newest live step) of
    ``root``, all or nothing (see the module docstring). Raises ``FleetSwitchError`` (after writing
    the record) unless every member serves the target step; ``BusyError`` if another coordinator
    holds the fleet's lease for more than ``wait`` seconds.

    The seams a test or a simulation drives it by: ``clock`` (every time read and wait of the lease
    and the holds), ``connect`` (a member's receiver from its URL; default the registry's kind,
    ``receivers.member``), ``renew_in_background`` (False: the lease is renewed only between the
    phases, in this thread), ``lease_seconds`` and ``holder`` (who the lease names; default this
    process, with a random id)."""
    layout.fleet_key(name)
    wait, ttl = fleet_lease.check_wait(wait), fleet_lease.check_ttl(lease_seconds)
    ref = RootRef(os.fspath(root), dict(storage_options or {}))
    parsed = parse_members(name, list(engines))
    tasks = FleetSteps(runner or InProcess())
    connect = connect or (lambda url: receivers.member(url, timeout=timeout))
    with contextlib.ExitStack() as held:  # each member's receiver, for the steps of this switch; the lease
        members = [{"url": m.url, "receiver": m.receiver, "ref": held.enter_context(local_refs.holding(connect(m.url), "member"))}
                   for m in parsed]
        admit_members(ref, name, members)
        target_step(ref, step)  # a ROOT or step that cannot be switched to: refused before the lease is written
        lease = held.enter_context(fleet_lease.held(open_root(ref), name, ttl, wait, clock, renew_in_background, holder))
        try:
            hold_members(name, members, timeout, clock)
            return _switch_fleet(tasks, ref, name, members, step, lease, clock)
        finally:  # whatever a failure left prepared or locked (nothing, when the switch ran its course)
            _each(members, lambda m: _receiver(m).release())


def admit_members(root: RootRef, name: str, members: list[dict]) -> None:
    """Before anything is read or changed (the lease included): one target named twice (a state
    file by two paths, a link and its target) is refused, and so is a switch a member would refuse
    (``Receiver.admit``: a server is sent no credentials), each in one line naming the member."""
    seen: dict[str, str] = {}
    for m in members:
        r = _receiver(m)
        first = seen.setdefault(r.identity, m["url"])
        if first != m["url"]:
            raise UsageError(f"--engine {first} and --engine {m['url']} are one member ({r.identity}); name each once")
        r.admit(Binding(root, m["receiver"], coordinator=name))


def hold_members(name: str, members: list[dict], timeout: float, clock: Clock = SYSTEM) -> None:
    """What each member holds alone for the switch (a state file's lock), taken one member at a time
    in the order of their identities (the one order every coordinator takes them in, whatever order
    its ``--engine`` options came in: two switches over the same members never wait on each other in
    a cycle), all within ``timeout`` (``BusyError`` past it, before anything changed)."""
    deadline = clock.monotonic() + timeout
    for m in sorted(members, key=lambda m: _receiver(m).identity):
        events.reached("fleet.member-hold", fleet=name, member=m["url"])
        try:
            _receiver(m).hold(max(0.0, deadline - clock.monotonic()))
        except BusyError:
            raise BusyError(f"fleet {name}: nobody switched: {m['url']} is held by another writer (a receive, a "
                            f"materialize or a fleet switch) and did not come free in {timeout:g} s (the timeout)") from None


def _keep(lease: fleet_lease.FleetLease, then: str) -> None:
    """Between two phases: the lease renewed, or the switch stops here (``FleetSwitchError``)."""
    try:
        lease.renew()
    except FencedError as e:
        raise FleetSwitchError(f"{e}; it stopped before {then}") from None


def _switch_fleet(tasks: FleetSteps, ref: RootRef, name: str, members: list[dict], step: int | None,
                  lease: fleet_lease.FleetLease, clock: Clock) -> FleetResult:
    t0 = time.perf_counter()
    plan = tasks.resolve_fleet(ref, name, members, step)
    target, previous, members = plan["target"], plan["previous"], plan["members"]
    _keep(lease, "preparing (nothing changed)")
    prepared = tasks.prepare_members(ref, name, members, target, lease.epoch)
    failed = [m for m in prepared if not m["ok"]]
    if failed:
        tasks.drop_prepared(prepared)
        done = [{**m, "outcome": "not-switched" if m["ok"] else "failed"} for m in prepared]
        return _finish(tasks, ref, name, target, previous, "aborted", done, t0, lease, clock,
                       f"nobody switched: {failed[0]['url']} could not prepare step {target} ({failed[0]['error']})")
    try:
        _keep(lease, "applying (what the members prepared was dropped)")
        _announce(tasks, ref, name, target, previous, members, lease, clock)
    except FleetSwitchError:
        tasks.drop_prepared(prepared)
        raise
    try:  # still live, now that the record says the switch is under way: a retraction before this stops it
        target_step(ref, target)
    except StepNotFoundError:
        tasks.drop_prepared(prepared)
        done = [{**m, "outcome": "not-switched"} for m in prepared]
        return _finish(tasks, ref, name, target, previous, "aborted", done, t0, lease, clock,
                       f"nobody switched: step {target} was retracted while the members prepared it")
    applied = tasks.apply_members(members, target)
    failed = [m for m in applied if not m["ok"]]
    if not failed:
        done = [{**m, "outcome": "unchanged" if m["previous"] == target else "switched"} for m in applied]
        return _finish(tasks, ref, name, target, previous, "unchanged" if previous == target and all(
            d["outcome"] == "unchanged" for d in done) else "switched", done, t0, lease, clock, None)
    why = f"{failed[0]['url']} failed to apply step {target} ({failed[0]['error']})"
    _keep(lease, f"taking members back ({why}): where they end is the new coordinator's switch")
    switched = [m for m in applied if (m["ok"] or m.get("applied")) and m["previous"] != target]
    back = tasks.take_back_members(switched)
    back_by = {m["receiver"]: m for m in back}
    done = []
    for m in applied:
        if m["receiver"] in back_by:
            b = back_by[m["receiver"]]
            done.append({**m, "outcome": "taken-back"} if b["back"] else
                        {**m, "outcome": "switched" if m["ok"] else "failed", "error": b["back_error"]})
        elif m["ok"]:
            done.append({**m, "outcome": "unchanged"})
        else:  # its engine put itself back, unless it is gone or says it must be reloaded
            lost = not m["answered"] or "must be reloaded" in m["error"] or m.get("applied")
            done.append({**m, "outcome": "failed", "lost": bool(lost)})
    return _finish(tasks, ref, name, target, previous, "taken-back", done, t0, lease, clock, why)


def _announce(tasks: FleetSteps, ref: RootRef, name: str, target: int, previous: int | None, members: list[dict],
              lease: fleet_lease.FleetLease, clock: Clock) -> None:
    """Before the first member changes (none will: nothing): the record says that a switch to
    ``target`` is under way (``switching``, no version, every member's step unknown), so that from
    now until this switch's own record, whatever happens to this coordinator, the record names no
    step a member may have left. Written, as every record, only if no newer epoch wrote one."""
    if all(_unchanged(m, target) for m in members):
        return
    entries = [{**m, "step": None, "outcome": "unchanged" if _unchanged(m, target) else "switching"} for m in members]
    try:
        tasks.record_fleet(ref, name, target, previous, "switching", entries, lease.epoch, lease.holder.id,
                           clock.time())
    except FencedError as e:
        raise FleetSwitchError(f"{e}; it stopped before applying (what the members prepared was dropped)") from None


def _finish(tasks: FleetSteps, ref: RootRef, name: str, target: int, previous: int | None, outcome: str,
            members: list[dict], t0: float, lease: fleet_lease.FleetLease, clock: Clock, error: str | None) -> FleetResult:
    """Every member asked its step, then the record written from what they said; ``FleetSwitchError``
    unless every member serves the target."""
    members = tasks.read_back_members(members)
    events.reached("fleet.read-back", fleet=name, steps=[m["step"] for m in members])
    try:
        rec = tasks.record_fleet(ref, name, target, previous, outcome, members, lease.epoch, lease.holder.id,
                                 clock.time())
    except FencedError as e:
        raise FleetSwitchError(str(e)) from None
    result = FleetResult(name, rec["outcome"], rec["version"], target, previous, rec["members"], time.perf_counter() - t0)
    if rec["outcome"] in ("switched", "unchanged"):
        return result
    if rec["outcome"] == "unconfirmed":
        off = next(m for m in rec["members"] if m["step"] != target)
        said = "did not answer" if off["step"] is None else f"says it serves step {off['step']}"
        error = f"every member applied step {target}, but {off['url']} {said} (see the fleet record)"
    elif rec["outcome"] == "mixed":
        error = (error or f"switched to step {target}") + "; the members are not all on one step now (see the fleet record)"
    elif outcome == "taken-back":
        error = error + ("; every member was taken back to its previous step" if rec["version"] is not None else
                         "; every member that answered was taken back, but not every member's step is known "
                         "(see the fleet record)")
    raise FleetSwitchError(f"fleet {name}: {error}", result)
