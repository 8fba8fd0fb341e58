"""A fleet's coordinator lease: one ``dcr fleet`` per fleet at a time, and the epoch that fences its members.

The lease of fleet NAME is a series of objects, ``fleets/NAME/lease/<epoch:012d>.json``, one per
epoch, each created only if absent (``Root.create_if_absent``: atomic on every backend). Each holds
its holder (host, pid, a random id, and on Linux the process's identity on its machine), when it
was taken, when it expires, and whether it was released. The newest epoch is the lease; older ones
are history (the last ``KEEP`` are kept).

Taking it (``take``): list the objects and read the newest, epoch E (none: E = 0). If it is
*held* (not released, not expired, its holder not known dead) the fleet is busy: wait (``wait``
seconds, polling) or refuse in one line naming the holder and when the lease ends. Otherwise create
epoch E + 1 only if absent: of coordinators racing for it exactly one creates it and holds the
lease at that epoch; the others look again and find it held. The creator lists once more: if an
epoch above its own exists (it was paused between its look and its create long enough for the
lease to move on and the old objects to be pruned), it holds nothing and starts over.

Holding it: the holder renews by rewriting its own object (only its holder writes an epoch's
object) with a later expiry, from a thread every third of the lease's length and between the
phases of a switch (``FleetLease.renew``); a renewal that finds a newer epoch, or comes after the
holder's own expiry, says the lease is lost (``FencedError``) and the coordinator stops. Release
rewrites it as released, so the next coordinator need not wait for the expiry. Epochs only grow:
the newest object is never deleted, only marked released.

A holder that died: taken over after its expiry. On Linux a lease also records its process's
identity on its machine (boot id, pid namespace, uid, start time); a taker of the same boot, pid
namespace and uid sees whether that process still runs and, if it does not (kill -9, OOM), takes
the lease at once. Nothing else frees a lease early: a holder on another machine is never presumed
dead.

Clocks and pauses are not trusted for correctness. A taker honours a lease until its expiry plus
``CLOCK_MARGIN`` by its own clock (so a holder's clock may run that much behind); a holder stops
at its own expiry. A holder paused past its expiry (a GC pause, SIGSTOP, a partition) may still act
as if it held the lease: what makes that safe is the epoch, not the lease. Every switch carries its
lease's epoch, every member keeps the highest epoch it has seen for the fleet and refuses older
ones (``flows.receive.receiver.Receiver.admit``), and the fleet's record is written only by an epoch
no older than the record's (``storage.fleet``). The lease keeps coordinators from getting in each
other's way; the fencing keeps a stale one from changing anything.

The clock (``dcr_core.clock``), the holder and the test of a dead holder are parameters, so a
simulation can run this code against a clock it moves by hand.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Final, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from dcr_core import events
from dcr_core.clock import SYSTEM, Clock
from dcr_core.errors import BusyError, DCRError, FencedError, UsageError
from storage import layout
from storage.root import Root

log = logging.getLogger("dcr.fleet")

FORMAT: Final = "dcr-fleet-lease"
DEFAULT_TTL = 30.0  # renewed every third of it while a switch runs: a dead holder on another machine blocks this long
MAX_TTL = 3600.0
CLOCK_MARGIN = 10.0  # a taker honours a lease this long past its expiry (the holder's clock may run behind)
KEEP = 4  # lease objects kept (the newest included)
MAX_LEASE_BYTES = 4096
MAX_POLL = 1.0  # the longest pause between two looks while waiting for a lease


class Holder(BaseModel):
    """Who holds a lease: ``host``, ``pid`` and a random ``id`` (per lease taken), and where the
    system says, the process's identity on its machine (``boot``, ``pid_ns``, ``uid``, ``started``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    host: str
    pid: int
    id: str
    boot: str | None = None
    pid_ns: str | None = None
    uid: int | None = None
    started: int | None = None

    def describe(self) -> str:
        return f"{self.host} pid {self.pid} ({self.id})"


class LeaseRecord(BaseModel):
    """One epoch's lease object."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    format: Literal["dcr-fleet-lease"] = FORMAT
    fleet: str
    epoch: int = Field(ge=1, le=layout.MAX_STEP)
    holder: Holder
    taken_at: float
    expires_at: float
    released: bool = False


def check_ttl(ttl: float) -> float:
    if isinstance(ttl, bool) or not isinstance(ttl, int | float) or not math.isfinite(ttl) or not 0 < ttl <= MAX_TTL:
        raise UsageError(f"a fleet's lease lasts more than 0 and at most {MAX_TTL:.0f} seconds, got {ttl!r}")
    return float(ttl)


def check_wait(wait: float) -> float:
    if isinstance(wait, bool) or not isinstance(wait, int | float) or not math.isfinite(wait) or wait < 0:
        raise UsageError(f"--wait: expected a number of seconds of at least 0, got {wait!r}")
    return float(wait)


# -- who holds it, and whether that process still runs ------------------------------------------------


def _start_time(pid: int) -> int | None:
    """The start time of process ``pid`` (clock ticks since boot, ``/proc/PID/stat`` field 22);
    None if there is no such process (or no ``/proc``)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        return int(stat.rsplit(b")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def _machine() -> dict:
    """This process's place on its machine (Linux): boot id, pid namespace, uid; {} elsewhere."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return {"boot": boot, "pid_ns": os.readlink("/proc/self/ns/pid"), "uid": os.getuid()}
    except (OSError, AttributeError):
        return {}


def this_holder() -> Holder:
    """This process as a lease's holder, with a fresh random id."""
    place = _machine()
    started = _start_time(os.getpid()) if place else None
    return Holder(host=socket.gethostname(), pid=os.getpid(), id=uuid.uuid4().hex[:12], started=started, **place)


def holder_gone(holder: Holder) -> bool:
    """True only when certain that ``holder``'s process no longer runs: it ran on this boot of this
    machine, in this pid namespace, as this user (its ``/proc`` entry is then visible here), and no
    process of its pid started when it did. False whenever that cannot be told."""
    here = _machine()
    if not here or holder.started is None or (holder.boot, holder.pid_ns, holder.uid) != (
            here["boot"], here["pid_ns"], here["uid"]):
        return False
    return _start_time(holder.pid) != holder.started


# -- reading the lease ---------------------------------------------------------------------------------


def _epochs(root: Root, name: str) -> list[int]:
    found = (layout.parse_numbered(n) for n in root.listdir(layout.fleet_leases_dir(name)))
    return sorted(e for e in found if e is not None)


def _read(root: Root, name: str, epoch: int) -> LeaseRecord | None:
    """Epoch ``epoch``'s lease object; None if it is gone or is not a lease (logged: it holds nothing)."""
    key = layout.numbered_key(layout.fleet_leases_dir(name), epoch)
    try:
        rec = LeaseRecord.model_validate_json(root.read(key, limit=MAX_LEASE_BYTES))
    except FileNotFoundError:
        return None
    except (ValidationError, ValueError) as e:
        log.warning("%s/%s: not a DCR fleet lease (%s); it holds nothing", root.url, key, type(e).__name__)
        return None
    if (rec.fleet, rec.epoch) != (name, epoch):
        log.warning("%s/%s: names fleet %r epoch %d; it holds nothing", root.url, key, rec.fleet, rec.epoch)
        return None
    return rec


def newest(root: Root, name: str) -> tuple[int, LeaseRecord | None]:
    """The fleet's newest epoch (0: never leased) and its lease object (None: unreadable or gone)."""
    epochs = _epochs(root, name)
    if not epochs:
        return 0, None
    return epochs[-1], _read(root, name, epochs[-1])


def is_held(rec: LeaseRecord | None, now: float, gone: Callable[[Holder], bool] = holder_gone) -> bool:
    """Whether a taker at time ``now`` (its clock) must honour lease ``rec``: not released, not past
    its expiry plus ``CLOCK_MARGIN``, not claiming more than ``MAX_TTL`` ahead (no holder takes
    that: garbage), and its holder not known dead."""
    if rec is None or rec.released or not math.isfinite(rec.expires_at):
        return False
    if rec.expires_at + CLOCK_MARGIN <= now or rec.expires_at > now + MAX_TTL + CLOCK_MARGIN:
        return False
    return not gone(rec.holder)


def utc(at: float) -> str:
    """``at`` (epoch seconds) as an ISO 8601 UTC time, as lease messages give it."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(at))


def busy_message(name: str, rec: LeaseRecord, now: float, wait: float) -> str:
    left = max(0.0, rec.expires_at - now)
    said = (f"fleet {name}: another coordinator is switching it: {rec.holder.describe()} holds its lease (epoch "
            f"{rec.epoch}) until {utc(rec.expires_at)} (in {left:.0f} s, renewed while it switches)")
    if wait > 0:
        return f"{said}; it did not come free in {wait:g} s (--wait)"
    return f"{said}; retry later, or pass --wait SECONDS"


# -- taking, renewing, releasing -----------------------------------------------------------------------


class FleetLease:
    """The lease of fleet ``name`` held by this process at ``epoch`` (``take`` makes one)."""

    def __init__(self, root: Root, name: str, rec: LeaseRecord, ttl: float, clock: Clock = SYSTEM):
        self.root, self.name, self.ttl, self.clock = root, name, ttl, clock
        self._rec = rec
        self._lost: FencedError | None = None
        self._released = False
        self._lock = threading.Lock()

    @property
    def epoch(self) -> int:
        return self._rec.epoch

    @property
    def holder(self) -> Holder:
        return self._rec.holder

    @property
    def expires_at(self) -> float:
        return self._rec.expires_at

    @property
    def key(self) -> str:
        return layout.numbered_key(layout.fleet_leases_dir(self.name), self.epoch)

    def renew(self) -> None:
        """Extend the lease by its length from now; ``FencedError`` if it is lost (a newer epoch
        exists, or its expiry passed before a renewal got through). A renewal the store refuses is
        logged: the lease still holds until its expiry."""
        with self._lock:
            if self._lost is not None:
                raise self._lost
            if self._released:
                raise UsageError(f"fleet {self.name}: the lease of epoch {self.epoch} was released")
            now = self.clock.time()
            if now >= self._rec.expires_at:
                self._lose(f"it expired at {utc(self._rec.expires_at)} before a renewal got through")
            rec = self._rec.model_copy(update={"expires_at": now + self.ttl})
            try:
                self.root.write(self.key, rec.model_dump_json().encode())
                latest = _epochs(self.root, self.name)
            except (DCRError, OSError) as e:
                log.warning("fleet %s: renewing the lease of epoch %d failed (%s: %s); it holds until %s",
                            self.name, self.epoch, type(e).__name__, e, utc(self._rec.expires_at))
                return
            self._rec = rec
            if latest and latest[-1] > self.epoch:
                other = _read(self.root, self.name, latest[-1])
                self._lose(f"{other.holder.describe() if other else 'another coordinator'} took it over at epoch "
                           f"{latest[-1]}")
        events.reached("fleet.lease-renewed", fleet=self.name, epoch=self.epoch)

    def _lose(self, why: str) -> None:
        self._lost = FencedError(f"fleet {self.name}: this coordinator lost its lease (epoch {self.epoch}): {why}")
        raise self._lost

    @property
    def lost(self) -> FencedError | None:
        return self._lost

    def release(self) -> None:
        """Mark the lease released (best effort: it expires anyway), unless it was lost."""
        with self._lock:
            if self._released or self._lost is not None:
                return
            self._released = True
            try:
                self.root.write(self.key, self._rec.model_copy(update={"released": True}).model_dump_json().encode())
            except (DCRError, OSError) as e:
                log.warning("fleet %s: releasing the lease of epoch %d failed (%s); it expires at %s",
                            self.name, self.epoch, e, utc(self._rec.expires_at))


def take(root: Root, name: str, ttl: float = DEFAULT_TTL, wait: float = 0.0, clock: Clock = SYSTEM,
         holder: Holder | None = None, gone: Callable[[Holder], bool] = holder_gone) -> FleetLease:
    """Take the lease of fleet ``name`` for ``ttl`` seconds (see the module docstring), waiting up to
    ``wait`` seconds for a holder to let go; ``BusyError`` (one line naming the holder and when its
    lease ends) if none did."""
    ttl, wait = check_ttl(ttl), check_wait(wait)
    holder = holder or this_holder()
    leases = layout.fleet_leases_dir(name)
    deadline = clock.monotonic() + wait
    poll, waiting = 0.05, False
    while True:
        epoch, rec = newest(root, name)
        now = clock.time()
        if rec is not None and rec.holder.id == holder.id and not rec.released:  # ours: the create's reply was lost
            return _taken(root, name, rec, ttl, clock)
        if not is_held(rec, now, gone):
            mine = LeaseRecord(fleet=name, epoch=epoch + 1, holder=holder, taken_at=now, expires_at=now + ttl)
            if root.create_if_absent(layout.numbered_key(leases, epoch + 1), mine.model_dump_json().encode()):
                latest = _epochs(root, name)
                if not latest or latest[-1] == mine.epoch:
                    return _taken(root, name, mine, ttl, clock)
                log.info("fleet %s: epoch %d taken too late (a newer one exists); looking again", name, mine.epoch)
            continue  # another coordinator created it first: look again (it holds the lease now)
        assert rec is not None  # held
        if clock.monotonic() >= deadline:
            raise BusyError(busy_message(name, rec, now, wait))
        if not waiting:
            waiting = True
            log.info("fleet %s: waiting for %s (epoch %d) to let go of the lease", name, rec.holder.describe(), epoch)
            events.reached("fleet.lease-waiting", fleet=name, epoch=epoch)
        clock.sleep(max(0.0, min(poll, deadline - clock.monotonic())))
        poll = min(poll * 1.5, MAX_POLL)


def _taken(root: Root, name: str, rec: LeaseRecord, ttl: float, clock: Clock) -> FleetLease:
    events.reached("fleet.lease-taken", fleet=name, epoch=rec.epoch)
    prune(root, name, rec.epoch)
    return FleetLease(root, name, rec, ttl, clock)


def prune(root: Root, name: str, epoch: int) -> None:
    """Delete lease objects older than the ``KEEP`` newest up to ``epoch`` (best effort)."""
    for old in [e for e in _epochs(root, name) if e <= epoch][:-KEEP]:
        with contextlib.suppress(FileNotFoundError, DCRError, OSError):
            root.remove(layout.numbered_key(layout.fleet_leases_dir(name), old))


class _Renewal:
    """Renews a lease every ``every`` seconds from a daemon thread until stopped or lost."""

    def __init__(self, lease: FleetLease, every: float):
        self.lease, self.every = lease, every
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"dcr-lease-{lease.name}", daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            try:
                self.lease.renew()
            except FencedError as e:
                log.warning("%s", e)
                return
            except Exception as e:  # noqa: BLE001 - the next renewal (or the coordinator's own) tries again
                log.warning("fleet %s: renewing the lease failed (%s: %s)", self.lease.name, type(e).__name__, e)

    def __enter__(self) -> _Renewal:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


@contextlib.contextmanager
def held(root: Root, name: str, ttl: float = DEFAULT_TTL, wait: float = 0.0, clock: Clock = SYSTEM,
         renew_in_background: bool = True, holder: Holder | None = None,
         gone: Callable[[Holder], bool] = holder_gone) -> Iterator[FleetLease]:
    """The lease of fleet ``name`` (``take``), renewed from a thread every third of ``ttl`` unless
    ``renew_in_background`` is False (a caller that renews it itself), released at the end."""
    lease = take(root, name, ttl, wait, clock, holder, gone)
    try:
        with _Renewal(lease, ttl / 3) if renew_in_background else contextlib.nullcontext():
            yield lease
    finally:
        lease.release()
