"""A seeded cooperative scheduler over real threads: exactly one simulated thread runs at a time, and
a ``random.Random(seed)`` picks which one, so a seed replays a schedule exactly.

Every thread of a simulated schedule is started here (``spawn``), as part of a simulated
``Process`` (a coordinator, one life of a member server, the operator). It runs only when the
scheduler hands it the turn, and gives the turn back at its next *scheduling point* (``point``):
every storage operation, member request, clock read and sleep of the code under test reaches one
(the seams of ``dcr_bench.fleet_sim.world``). Between two points a thread runs alone, so
everything that happens between them is one *event*; the scheduler checks the invariants after
each. A thread can wait for a condition (``wait_until``: it is picked only once the condition
holds, or its deadline passed) or for simulated time (``sleep``): nothing in the simulation waits
on real time, so every wait resolves deterministically, and when every thread waits for time the
clock jumps to the earliest deadline.

A process that crashes (``crash``) stops at the point it reached: its threads are never picked
again, and nothing after that point runs, ``finally`` blocks included, like ``kill -9``. When a
schedule ends, threads still parked (crashed or waiting) are unwound with ``SimKilled`` (a
``BaseException`` no ``except Exception`` stops): whatever they do then touches a world that is
already over, and every point they reach raises again.

A thread that blocks on something the scheduler does not see (a lock held across a point by a
parked thread) would stall the run: the driver waits for the turn back at most ``STALL_SECONDS``
of real time, then fails naming the thread and its last point; the harness avoids such waits.
"""

from __future__ import annotations

import hashlib
import random
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

STALL_SECONDS = 60.0  # real time a thread may take between two points before the run is called stalled
TRACE = 60  # events kept for a failure's message


class SimKilled(BaseException):
    """Raised in a simulated thread whose process crashed or whose schedule is over."""


class Stalled(RuntimeError):
    """The simulation itself could not go on (a thread blocked outside the scheduler, or every thread
    waiting on a condition that can never hold: a deadlock of the code under test)."""


@dataclass(eq=False)
class Process:
    """A simulated process: its threads stop together when it crashes."""

    name: str
    alive: bool = True
    paused_until: float = 0.0  # simulated time: none of its threads runs before (a GC pause, SIGSTOP)
    threads: list[SimThread] = field(default_factory=list)


@dataclass(eq=False)
class SimThread:
    name: str
    process: Process
    fn: Callable[[], Any]
    state: str = "new"  # new, parked, running, done
    label: str = "start"  # the point it is parked at
    ready: Callable[[], bool] | None = None  # picked only once this holds (or wake_at passed)
    wake_at: float | None = None  # simulated time it waits for
    killed: bool = False
    result: Any = None
    error: BaseException | None = None
    thread: threading.Thread | None = None
    turn: threading.Semaphore = field(default_factory=lambda: threading.Semaphore(0))

    @property
    def done(self) -> bool:
        return self.state == "done"

    def join(self) -> None:
        """Wait (as a simulated thread) until this thread is done: what ``threading.Thread.join``
        is in the simulation."""
        current().scheduler.wait_until(lambda: self.done, f"join {self.name}")

    def is_alive(self) -> bool:
        return not self.done


_local = threading.local()


@dataclass(frozen=True)
class _Current:
    scheduler: Scheduler
    thread: SimThread


def current() -> _Current:
    """The scheduler and simulated thread of the calling thread; ``RuntimeError`` in any other."""
    me = getattr(_local, "me", None)
    if me is None:
        raise RuntimeError(f"thread {threading.current_thread().name!r} reached a scheduling point, but the "
                           "simulation did not start it (a pool or thread the harness does not replace)")
    return me


def in_simulation() -> bool:
    return getattr(_local, "me", None) is not None


class Scheduler:
    """One schedule's threads and simulated time (see the module docstring). ``step``: the simulated
    seconds one event takes (drawn per event); ``after_event``: called by the driver after every
    event, while every simulated thread is parked (the invariants, and the faults injected)."""

    def __init__(self, seed: int, step: Callable[[random.Random], float] = lambda rng: 0.0,
                 echo: Callable[[str], None] | None = None):
        self.seed = seed
        self.rng = random.Random(seed)
        self.now = 0.0  # simulated seconds since the schedule started
        self.events = 0
        self.threads: list[SimThread] = []
        self.trace: deque[str] = deque(maxlen=TRACE)
        self._step = step
        self._back = threading.Semaphore(0)  # a simulated thread gives the turn back
        self._over = False
        self._echo = echo  # every event's line, as it happens (``--trace``)
        self._digest = hashlib.blake2b(digest_size=8)  # of every event's line: two runs of a seed compare equal

    # -- threads ---------------------------------------------------------------------------------

    def spawn(self, process: Process, name: str, fn: Callable[[], Any]) -> SimThread:
        """A new simulated thread of ``process`` running ``fn``; it runs when first picked."""
        t = SimThread(name, process, fn)
        process.threads.append(t)
        self.threads.append(t)
        t.thread = threading.Thread(target=self._run, args=(t,), name=f"sim-{name}", daemon=True)
        t.thread.start()
        return t

    def _run(self, t: SimThread) -> None:
        _local.me = _Current(self, t)
        t.turn.acquire()
        try:
            if t.killed:
                raise SimKilled(t.name)
            t.result = t.fn()
        except BaseException as e:  # noqa: BLE001 - kept for whoever joins it (SimKilled included)
            t.error = e
        finally:
            t.state = "done"
            self._back.release()

    def crash(self, process: Process) -> None:
        """``process`` dies where its threads are parked (driver only)."""
        process.alive = False

    def pause(self, process: Process, seconds: float) -> None:
        """``process`` stops for ``seconds`` of simulated time where its threads are parked, then
        goes on unaware (driver only)."""
        process.paused_until = max(process.paused_until, self.now + seconds)

    # -- what a simulated thread calls -----------------------------------------------------------

    def point(self, label: str) -> None:
        """A scheduling point: give the turn back and wait to be picked again."""
        self._park(label, None, None)

    def wait_until(self, ready: Callable[[], bool], label: str, deadline: float | None = None) -> bool:
        """Wait until ``ready()`` holds (True) or simulated time reaches ``deadline`` (False)."""
        while not ready():
            if deadline is not None and self.now >= deadline:
                return False
            self._park(label, ready, deadline)
        return True

    def sleep(self, seconds: float, label: str = "sleep") -> None:
        self._park(label, None, self.now + max(0.0, seconds))

    def _park(self, label: str, ready: Callable[[], bool] | None, wake_at: float | None) -> None:
        me = current()
        if me.scheduler is not self:
            raise RuntimeError("a simulated thread reached another schedule's point")
        t = me.thread
        if t.killed or self._over:
            raise SimKilled(t.name)
        t.label, t.ready, t.wake_at, t.state = label, ready, wake_at, "parked"
        self._back.release()
        t.turn.acquire()
        if t.killed:
            raise SimKilled(t.name)

    # -- the driver ------------------------------------------------------------------------------

    def _runnable(self, t: SimThread) -> bool:
        if t.state not in ("new", "parked") or not t.process.alive or self.now < t.process.paused_until:
            return False
        if t.wake_at is not None and self.now >= t.wake_at:
            return True
        if t.ready is not None:
            return t.ready()
        return t.wake_at is None

    def run(self, after_event: Callable[[SimThread], None], max_events: int) -> None:
        """Run until no thread can run again (every one done, crashed, or waiting on a condition
        that cannot hold: ``Stalled``), or ``max_events``."""
        while self.events < max_events:
            runnable = [t for t in self.threads if self._runnable(t)]
            if not runnable:
                waiting = [t for t in self.threads if t.state in ("new", "parked") and t.process.alive]
                timed = [max(t.wake_at if t.wake_at is not None else self.now, t.process.paused_until) for t in waiting
                         if t.wake_at is not None or t.process.paused_until > self.now]
                if timed:
                    self.now = max(self.now, min(timed))
                    continue
                stuck = [t for t in self.threads if t.state in ("new", "parked") and t.process.alive]
                if stuck:
                    raise Stalled("deadlock: every live thread waits on a condition that cannot hold: "
                                  + "; ".join(f"{t.name} at {t.label}" for t in stuck))
                return
            t = self.rng.choice(runnable)
            self.now += self._step(self.rng)
            t.state = "running"
            t.turn.release()
            if not self._back.acquire(timeout=STALL_SECONDS):
                raise Stalled(f"{t.name} did not reach a scheduling point within {STALL_SECONDS:.0f} s of real time "
                              f"(after {t.label}): it blocks on something the simulation does not schedule")
            self.events += 1
            line = f"{self.events:6d} t={self.now:8.3f} {t.name}: {t.label}" + (" (done)" if t.done else "")
            self.trace.append(line)
            self._digest.update(line.encode())
            if self._echo is not None:
                self._echo(line)
            after_event(t)

    @property
    def digest(self) -> str:
        return self._digest.hexdigest()

    def finish(self) -> None:
        """Unwind every thread still parked (``SimKilled``) and wait for them to end."""
        self._over = True
        for t in self.threads:
            if t.state != "done":
                t.killed = True
                t.turn.release()
        for t in self.threads:
            if t.thread is not None:
                t.thread.join(STALL_SECONDS)
