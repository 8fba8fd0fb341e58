"""The invariants of a fleet switch, checked after every event of a simulated schedule.

What a member *serves* is the step its engine holds (``SimWeights.step``), not what it says when
asked; a member that crashed serves nothing while it is down, and its next life serves the step of
its checkpoint directory until a switch reaches it (a restart is outside any coordinator's reach, so
what a coordinator or a record said before it does not cover that member).

1. **A switch that exited 0 holds.** Once a coordinator returned ``switched`` or ``unchanged`` for
   step T at epoch E, every member serves T (each member that has not restarted since it last told
   that coordinator its step) until another switch starts: until a coordinator takes the fleet's
   lease at an epoch above E.
2. **The record never names a step a member does not serve.** The fleet's record
   (``storage.fleet.read``, what a router reads) names, for each member, the step it serves or
   none; and its version, unless it is None (``mixed`` has none); every member named with a step
   serves it (each member that has not restarted since it last told the record's writer its step).
3. **Only committed, unretracted steps are served.** Every step a member serves is committed (its
   marker in ROOT), and no switch that began applying (its first record written: from then on it
   changes members) after a step's retraction was recorded puts a member on that step. A switch
   already applying when the retraction lands may finish: the next switch takes the fleet off the
   step, as it does for a fleet that served the step before it was retracted.

Each returns the number of checks it made; the first that fails raises ``Violation``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from storage import fleet, layout
from storage.root import open_root

if TYPE_CHECKING:
    from dcr_bench.fleet_sim.schedule import Schedule


class Violation(AssertionError):
    """An invariant broke (the message says which, the seed and the last events)."""


class Invariants:
    def __init__(self, schedule: Schedule):
        self.s = schedule
        self._seen_version = -1
        self._record: fleet.FleetRecord | None = None

    def record(self) -> fleet.FleetRecord | None:
        """The fleet's record as a reader finds it now (read again only after ROOT changed)."""
        store = self.s.store
        if store.version != self._seen_version:
            from dcr_bench.fleet_sim import world

            self._record = fleet.read(open_root(world.ROOT_URL), "f")
            self._seen_version = store.version
        return self._record

    def check(self) -> int:
        return self.switches_hold() + self.record_is_true() + self.served_steps_are_live()

    def switches_hold(self) -> int:
        s, checks = self.s, 0
        for c in s.coordinators:
            if not c.succeeded or c.epoch is None or s.max_epoch > c.epoch:
                continue
            target = c.result.target
            for m in s.members:
                if m.server is None or m.life_started > c.asked.get(m.url, c.returned_at or 0):
                    continue  # restarted since it last told this coordinator its step
                checks += 1
                if m.server.weights.step != target:
                    raise Violation(f"invariant 1: coordinator c{c.n} exited 0 ({c.result.outcome}, step {target}, "
                                    f"epoch {c.epoch}) and no switch started since, but {m.name} serves step "
                                    f"{m.server.weights.step}")
        return checks

    def record_is_true(self) -> int:
        s, checks = self.s, 0
        rec = self.record()
        if rec is None:
            return 0
        writer = next((c for c in s.coordinators if c.epoch == rec.epoch and c.lease_at is not None), None)
        written = s.record_written_at.get(rec.generation or 0, 0)
        by_name = {m.name: m for m in s.members}
        for entry in rec.members:
            m = by_name.get(entry.receiver)
            named = entry.step if entry.step is not None else None
            if rec.version is not None and named is None:
                named = rec.version
            if named is None or m is None or m.server is None:
                continue
            if m.life_started > (writer.asked.get(m.url, written) if writer is not None else written):
                continue  # restarted since it last told the record's writer its step
            checks += 1
            if m.server.weights.step != named:
                raise Violation(f"invariant 2: the record (generation {rec.generation}, epoch {rec.epoch}, "
                                f"{rec.outcome}, version {rec.version}) names step {named} for {m.name}, which "
                                f"serves step {m.server.weights.step}")
        return checks

    def served_steps_are_live(self) -> int:
        s, checks = self.s, 0
        objects, prefix = s.store.objects, s.store.path + "/"
        for m in s.members:
            if m.server is None:
                continue
            step = m.server.weights.step
            checks += 1
            if prefix + layout.commit_key(step) not in objects:
                raise Violation(f"invariant 3: {m.name} serves step {step}, which is not committed")
            retracted = s.retracted_at.get(step)
            if retracted is None:
                continue
            by = next((c for c in s.coordinators if m.moved_by is not None and c.epoch == m.moved_by), None)
            began = by.announced_at if by is not None and by.announced_at is not None else m.since
            if began > retracted:
                raise Violation(f"invariant 3: {m.name} serves step {step}, retracted at event {retracted}, by a switch "
                                f"that began applying at event {began}" + (f" (c{by.n}, epoch {by.epoch})" if by else ""))
        return checks
