"""One simulated schedule: a fleet of member servers, two or three coordinators switching it at once
(each the real ``flows.receive.fleet.run_fleet``), and the faults, all drawn from one seed.

What a seed decides: the number of members and coordinators, each coordinator's target (a step,
or the newest live one) and ``--wait``, each party's clock skew, the interleaving of every thread
(``scheduler``), the network's faults (``transport``), the engines' (``vllm_server.Faults``),
the rates of all of them (times 0.2, 1 or 2: ``Config.intensities``), and, between any two
events: a coordinator crashing (then, maybe, rerun as a new process) or pausing (a GC pause,
SIGSTOP: half the time just long enough for its lease to be taken, with a retry started beside
it), both likelier right before it sends a request that changes a member; a member crashing
(restarted a while later) or pausing; the newest steps retracted (the real ``dcr retract``); and
the clock jumping ahead.

When no thread can run any more, the last phase: every member that is down is restarted, faults
stop, and one more coordinator switches the fleet to the newest live step; it must succeed and
leave every member on that step, the record saying so (a rerun converges, whatever came before).
The invariants (``invariants``) are checked after every event of both phases.
"""

from __future__ import annotations

import dataclasses
import random
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dcr_bench.fleet_sim import world
from dcr_bench.fleet_sim.invariants import Invariants, Violation
from dcr_bench.fleet_sim.scheduler import Process, Scheduler, SimThread, Stalled, current
from dcr_bench.fleet_sim.transport import NetFaults, Network
from dcr_bench.fleet_sim.vllm_server import Faults, SimDataPath, VllmServer, engine_seams
from dcr_core.errors import BusyError, DCRError, StepNotFoundError
from flows.receive.fleet import FleetResult, run_fleet
from flows.receive.fleet_members import HttpServer
from storage import fleet, fleet_lease, layout
from storage.fleet_lease import Holder
from storage.root import open_root

FLEET = "f"
BOOT_STEP = 0  # the step in every member's checkpoint directory (what a restarted server serves)
SUCCESS = ("switched", "unchanged")
# the points of a coordinator right before a request that changes a member: a crash or a pause there
# is this many times likelier than elsewhere (a pause there is what the members' fencing is for)
CHANGES = ("fleet.member-update", "send /init_weight_transfer_engine", "send /start_weight_update",
           "send /update_weights", "send /finish_weight_update", "send /pause", "send /resume")
CRASH_BEFORE_A_CHANGE = 5.0
PAUSE_BEFORE_A_CHANGE = 30.0


@dataclass(frozen=True)
class Config:
    """What every schedule of a run shares; the seed draws the rest."""

    coordinators: int = 0  # 2 or 3; 0: drawn per schedule
    members: int = 0  # 2 or 3; 0: drawn per schedule
    lease_seconds: float = 30.0  # the default (storage.fleet_lease.DEFAULT_TTL); renewed between the phases
    timeout: float = 20.0  # each member request's, and the holds' (--timeout)
    event_seconds: float = 0.02  # simulated seconds an event takes, on average
    stall: float = 0.003  # per event: the clock jumps ahead by up to max_stall seconds
    max_stall: float = 45.0
    coordinator_crash: float = 0.0005  # per event, per running coordinator
    rerun: float = 0.7  # a crashed coordinator is run again (a new process), a paused one retried beside it
    max_coordinators: int = 8  # started in a schedule, reruns and retries included (the last one aside)
    coordinator_pause: float = 0.0005  # per event, per running coordinator: it stops, then goes on unaware
    member_pause: float = 0.0005  # per event, per member that is up
    takeover: float = 20.0  # a pause that loses the lease ends this long after another could take it
    member_crash: float = 0.0007  # per event, per member that is up
    restart_after: float = 30.0  # a crashed member is restarted within this many seconds
    retract: float = 0.35  # per schedule: the newest step(s) retracted at some point
    skew: float = 5.0  # each coordinator's wall clock is off by up to this much (either way)
    net: NetFaults = field(default_factory=NetFaults)
    engine: Faults = field(default_factory=Faults)
    max_events: int = 60_000
    intensities: tuple[float, ...] = (0.2, 1.0, 2.0)  # each schedule's faults: these rates times one of these
    echo: Callable[[str], None] | None = None  # every event's line as it happens (--trace)


def scaled(config: Config, k: float) -> Config:
    """``config`` with every rate of a fault multiplied by ``k``."""
    net, engine = config.net, config.engine
    return dataclasses.replace(
        config, stall=config.stall * k, coordinator_crash=config.coordinator_crash * k,
        member_crash=config.member_crash * k, coordinator_pause=config.coordinator_pause * k,
        member_pause=config.member_pause * k,
        net=dataclasses.replace(net, delayed=net.delayed * k, lost_request=net.lost_request * k,
                                lost_response=net.lost_response * k, duplicated=net.duplicated * k),
        engine=dataclasses.replace(engine, reload_fails=engine.reload_fails * k))


@dataclass(eq=False)
class Member:
    name: str
    url: str
    server: VllmServer | None = None  # its current life; None while it is down
    lives: int = 0
    life_started: float = 0.0  # when its current life began (an event's number, + 0.5: after that event)
    since: float = 0.0  # the event whose update put its current step in place (its life's start for the boot step)
    moved_by: int | None = None  # the epoch of the update that put it there (None: the boot step)
    restart_at: float | None = None

    @property
    def engine(self) -> str:
        return f"{self.name}={self.url}"


@dataclass(eq=False)
class Coordinator:
    n: int
    target: int | None
    wait: float
    process: Process
    thread: SimThread | None = None
    epoch: int | None = None  # the lease epoch it took
    lease_at: int | None = None  # the event it took the lease at
    announced_at: int | None = None  # the event its first record was written at (before it changes any member)
    asked: dict[str, int] = field(default_factory=dict)  # member URL -> the event it last said its step to it
    result: FleetResult | None = None
    error: str | None = None
    returned_at: int | None = None
    final: bool = False

    @property
    def succeeded(self) -> bool:
        return self.result is not None and self.result.outcome in SUCCESS


@dataclass
class Outcome:
    """A schedule's figures."""

    seed: int
    events: int = 0
    checks: int = 0
    coordinators: Counter = field(default_factory=Counter)  # what each ended with
    faults: Counter = field(default_factory=Counter)  # injected, by kind
    simulated_seconds: float = 0.0
    digest: str = ""  # of the schedule's events: a replay of the seed gives the same
    converged: bool = False  # the last coordinator brought every member to the newest live step


class Schedule:
    def __init__(self, seed: int, config: Config, published: dict[str, bytes], backend_cls: type):
        rng = random.Random(seed ^ 0x5EED)  # the schedule's shape, apart from the interleaving's generator
        self.intensity = rng.choice(config.intensities)
        self.seed, self.config = seed, scaled(config, self.intensity)
        config = self.config
        mean = config.event_seconds
        self.sched = Scheduler(seed, step=lambda r: r.expovariate(1.0 / mean) if mean else 0.0, echo=config.echo)
        self.outcome = Outcome(seed)
        self.counts = self.outcome.faults
        self.retracted_at: dict[int, int] = {}
        self.record_written_at: dict[int, int] = {}
        self.max_epoch = 0
        path = world.store_path()
        self.store = world.SimStore(path, world.objects_at(path, published), self._written)
        self.steps = sorted({layout.parse_step_dir(k.split("/")[1]) for k in published if k.startswith("steps/")}
                            - {None})
        n_members = config.members or rng.choice((2, 3))
        self.members = [Member(f"m{i}", f"http://m{i}:8000") for i in range(n_members)]
        self.by_url = {m.url: m for m in self.members}
        self.backend_cls = backend_cls
        self.network = Network(self.sched, lambda url: self.by_url[url].server, config.net, self.counts,
                               lambda: self.max_epoch, self._answered)
        self.data_path = SimDataPath(config.engine, self._applied)
        self.coordinators: list[Coordinator] = []
        self.plan = [(rng.choice([*self.steps[1:], None]), rng.choice((0.0, 60.0, 60.0)))
                     for _ in range(config.coordinators or rng.choice((2, 3)))]
        self.retract_step = rng.choice(self.steps[-2:]) if rng.random() < config.retract else None
        self.invariants = Invariants(self)
        self.final = False

    # -- bookkeeping -----------------------------------------------------------------------------

    def _written(self, key: str) -> None:
        parts = key.split("/")
        if len(parts) == 3 and parts[0] == "steps" and key == layout.retraction_key(int(parts[1])):
            self.retracted_at.setdefault(int(parts[1]), self.sched.events)
        elif key.startswith(layout.fleet_records_dir(FLEET) + "/"):
            generation = layout.parse_numbered(parts[-1])
            if generation is not None:
                self.record_written_at.setdefault(generation, self.sched.events)

    def _applied(self, engine: Any, step: int) -> None:
        for m in self.members:
            if m.server is not None and m.server.weights is engine.model:
                m.since, m.moved_by = m.server.update_began, m.server.update_epoch
        del step

    def _point(self, name: str, fields: dict) -> None:
        if name == "fleet.lease-taken":
            c = self._coordinator_of(current().thread.process)
            self.max_epoch = max(self.max_epoch, fields["epoch"])
            if c is not None:
                c.epoch, c.lease_at = fields["epoch"], self.sched.events
        elif name == "fleet.record-written":
            c = self._coordinator_of(current().thread.process)
            if c is not None and c.announced_at is None:
                c.announced_at = self.sched.events

    def _answered(self, url: str, route: str) -> None:
        if route == "/weight_info":
            c = self._coordinator_of(current().thread.process)
            if c is not None:
                c.asked[url] = self.sched.events

    def _coordinator_of(self, process: Process) -> Coordinator | None:
        return next((c for c in self.coordinators if c.process is process), None)

    # -- the parties -----------------------------------------------------------------------------

    def _boot(self, m: Member) -> None:
        m.lives += 1
        process = Process(f"{m.name}#{m.lives}")
        m.server = VllmServer(m.name, m.lives, process, BOOT_STEP, self.backend_cls)
        # after the event just run (lives start between events): anything that event did came before it
        m.life_started = m.since = m.server.update_began = self.sched.events + 0.5
        m.moved_by = None
        m.restart_at = None

    def _start_coordinator(self, target: int | None, wait: float, final: bool = False) -> Coordinator:
        n = len(self.coordinators) + 1
        c = Coordinator(n, target, wait, Process(f"c{n}"), final=final)
        skew = 0.0 if final else self.sched.rng.uniform(-self.config.skew, self.config.skew)
        clock = world.SimClock(self.sched, skew)
        timeout = self.config.timeout

        def connect(url: str) -> HttpServer:
            return HttpServer(url, timeout=timeout, call=self.network.call, clock=clock)

        def run() -> FleetResult:
            return run_fleet(world.ROOT_URL, [m.engine for m in self.members], step=target, name=FLEET,
                             timeout=timeout, wait=wait, lease_seconds=self.config.lease_seconds, clock=clock,
                             connect=connect, renew_in_background=False,
                             holder=Holder(host=f"coordinator-{n}", pid=n, id=f"c{n:011d}"))

        self.coordinators.append(c)
        c.thread = self.sched.spawn(c.process, f"c{n}", run)
        return c

    def _retract(self, step: int) -> None:
        from flows.maintenance.retract import run_retract

        self.sched.spawn(Process("operator"), f"retract {step}", lambda: run_retract(world.ROOT_URL, step))
        self.counts["retraction"] += 1

    # -- after every event -----------------------------------------------------------------------

    def _after(self, t: SimThread) -> None:
        c = self._coordinator_of(t.process)
        if c is not None and t is c.thread and t.done:
            self._returned(c, t)
        self.outcome.checks += self.invariants.check()
        if not self.final:
            self._chaos(t)

    def _returned(self, c: Coordinator, t: SimThread) -> None:
        c.returned_at = self.sched.events
        if isinstance(t.result, FleetResult):
            c.result = t.result
        elif isinstance(t.error, DCRError):
            c.error = f"{type(t.error).__name__}: {t.error}"
            result = getattr(t.error, "result", None)
            if isinstance(result, FleetResult):
                c.result = result
        else:
            raise Violation(f"coordinator c{c.n} ended with an unexpected {type(t.error).__name__}: {t.error}")
        if not c.final:
            self.outcome.coordinators[ended(c.result, t.error)] += 1


    def _pause_seconds(self) -> float:
        """As often a short pause as one just long enough for a lease to expire and be taken over
        (its length and the clock margin, then up to ``takeover`` seconds: the next coordinator is
        then switching when the paused one goes on)."""
        cfg, rng = self.config, self.sched.rng
        if rng.random() < 0.5:
            return rng.uniform(0.0, cfg.lease_seconds)
        return cfg.lease_seconds + fleet_lease.CLOCK_MARGIN + rng.uniform(0.0, cfg.takeover)

    def _chaos(self, t: SimThread) -> None:
        cfg, rng, sched = self.config, self.sched.rng, self.sched
        for c in list(self.coordinators):
            if not c.process.alive or c.thread is None or c.thread.done:
                continue
            # where the thread that just ran stopped, right before it changes a member: likelier there
            there = t.process is c.process and t.label.startswith(CHANGES)
            if rng.random() < cfg.coordinator_crash * (CRASH_BEFORE_A_CHANGE if there else 1.0):
                sched.crash(c.process)
                self.counts["coordinator-crash"] += 1
                self.outcome.coordinators["crashed (kill -9)"] += 1
                if rng.random() < cfg.rerun and len(self.coordinators) < cfg.max_coordinators:
                    self._start_coordinator(c.target, 60.0)
                    self.counts["coordinator-rerun"] += 1
            elif rng.random() < cfg.coordinator_pause * (PAUSE_BEFORE_A_CHANGE if there else 1.0):
                sched.pause(c.process, self._pause_seconds())
                self.counts["coordinator-pause"] += 1
                if rng.random() < cfg.rerun and len(self.coordinators) < cfg.max_coordinators:
                    # retried meanwhile (an RL loop whose call timed out): it waits for the lease
                    self._start_coordinator(rng.choice([*self.steps[1:], None]), 120.0)
                    self.counts["coordinator-retry-while-paused"] += 1
        for m in self.members:
            if m.server is not None and rng.random() < cfg.member_crash:
                sched.crash(m.server.process)
                m.server = None
                m.restart_at = sched.now + rng.uniform(0.5, cfg.restart_after)
                self.counts["member-crash"] += 1
            elif m.server is not None and rng.random() < cfg.member_pause:
                sched.pause(m.server.process, self._pause_seconds())
                self.counts["member-pause"] += 1
            elif m.server is None and m.restart_at is not None and sched.now >= m.restart_at:
                self._boot(m)
                self.counts["member-restart"] += 1
        if self.retract_step is not None and rng.random() < 0.002:
            step, self.retract_step = self.retract_step, None
            self._retract(step)
        if rng.random() < cfg.stall:
            sched.now += rng.uniform(0.0, cfg.max_stall)
            self.counts["clock-jump"] += 1

    # -- the run ---------------------------------------------------------------------------------

    def run(self) -> Outcome:
        try:
            with world.installed_root(self.store), world.progress_points(self._point), \
                    engine_seams(self.data_path, world.spawn_here), world.fleet_pool(), \
                    world.process_caches(self.sched):
                self._run()
        finally:
            self.sched.finish()
        self.outcome.events = self.sched.events
        self.outcome.simulated_seconds = self.sched.now
        self.outcome.digest = self.sched.digest
        return self.outcome

    def _run(self) -> None:
        for m in self.members:
            self._boot(m)
        for target, wait in self.plan:
            self._start_coordinator(target, wait)
        self.sched.run(self._after, self.config.max_events)
        self._converge()

    def _converge(self) -> None:
        """The last phase (see the module docstring)."""
        self.final = True
        self.network.faults = NetFaults(0.0, 0.0, 0.0, 0.0, 0.0)
        self.data_path.faults = Faults(self.config.engine.pull_seconds, self.config.engine.reload_seconds, 0.0)
        for m in self.members:
            if m.server is None:
                self._boot(m)
            m.server.process.paused_until = 0.0
        last = self._start_coordinator(None, 3600.0, final=True)
        self.sched.run(self._after, self.sched.events + self.config.max_events)
        if not last.succeeded:
            raise Violation(f"the last coordinator (no faults, every member up) did not converge: "
                            f"{last.error or (last.result.outcome if last.result else 'no result')}")
        target = last.result.target
        off = {m.name: m.server.weights.step for m in self.members if m.server.weights.step != target}
        rec = fleet.read(open_root(world.ROOT_URL), FLEET)
        if off or rec is None or rec.version != target:
            raise Violation(f"the last coordinator exited 0 for step {target}, but members {off or 'all at it'}; "
                            f"the record says version {rec.version if rec else None}")
        self.outcome.converged = True

    def describe(self) -> str:
        return (f"{len(self.members)} members, coordinators "
                + ", ".join(f"c{i + 1} -> {'newest' if t is None else t} (wait {w:g})" for i, (t, w) in enumerate(self.plan))
                + (f", step {self.retract_step} retracted" if self.retract_step is not None else ""))


def ended(result: FleetResult | None, error: BaseException | None) -> str:
    """How a coordinator ended, in a word or two (its record's outcome, or why it stopped)."""
    if result is not None:
        return f"exit 0: {result.outcome}" if result.outcome in SUCCESS else f"failed: {result.outcome}"
    said = str(error)
    if isinstance(error, BusyError):
        return "refused: busy"
    if isinstance(error, StepNotFoundError):
        return "refused: step not live"
    if "lost its lease" in said:
        return "stopped: lease lost"
    if "was written at epoch" in said:
        return "stopped: a newer record"
    return f"stopped: {type(error).__name__}"


def run_schedule(seed: int, config: Config, published: dict[str, bytes], backend_cls: type) -> Outcome:
    """Run schedule ``seed``; ``Violation`` (its message says the seed and the trace's tail) if an
    invariant broke, or the simulation stalled."""
    s = Schedule(seed, config, published, backend_cls)
    shape = s.describe()
    try:
        return s.run()
    except (Violation, Stalled) as e:
        trace = "\n".join(f"  {line}" for line in s.sched.trace)
        raise Violation(f"seed {seed} ({shape}): {e}\n  after event {s.sched.events} "
                        f"(simulated t={s.sched.now:.3f} s); the last events:\n{trace}\n"
                        f"replay: python -m dcr_bench.fleet_sim --seed {seed}") from None
