"""The network between coordinators and member servers: ``HttpServer``'s ``call`` seam, with faults.

A request is handled by the member's current life in a thread of that life (a crash stops it where
it is), after a delay; the caller waits for the answer, at most its timeout (simulated). Drawn per
request from the schedule's generator:

- ``delayed``: it reaches the server up to ``max_delay`` seconds late, so requests of different
  coordinators reorder, and one that comes after its caller's timeout is applied after the caller
  gave up (the caller saw a timeout);
- ``lost-request``: it never arrives (the caller times out);
- ``lost-response``: it is applied, and the caller gets an error instead of the answer;
- ``duplicated``: it arrives twice (a proxy's retry), and each copy is applied.

A member that is down refuses the connection; one that crashes while handling a request resets it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from dcr_bench.fleet_sim.scheduler import Scheduler, SimThread, current
from dcr_bench.fleet_sim.vllm_server import RequestError, VllmServer
from flows.receive.fleet_members import MemberError
from flows.receive.receiver import TOOK_OVER


@dataclass(frozen=True)
class NetFaults:
    delayed: float = 0.06
    max_delay: float = 40.0
    lost_request: float = 0.01
    lost_response: float = 0.02
    duplicated: float = 0.02


class Network:
    """Requests to the members by URL: ``server(url)`` is the member's current life (None: down)."""

    def __init__(self, scheduler: Scheduler, server: Callable[[str], VllmServer | None], faults: NetFaults,
                 counts: Counter, newest_epoch: Callable[[], int] = lambda: 0,
                 answered: Callable[[str, str], None] = lambda url, route: None):
        self.scheduler, self.server, self.faults, self.counts = scheduler, server, faults, counts
        self.newest_epoch = newest_epoch  # the newest lease epoch taken: a request of an older one is stale
        self.answered = answered  # (url, route) of each answer its caller got, in the caller's thread

    def _fault(self) -> str | None:
        f, x = self.faults, self.scheduler.rng.random()
        for name, p in (("delayed", f.delayed), ("lost-request", f.lost_request), ("lost-response", f.lost_response),
                        ("duplicated", f.duplicated)):
            if x < p:
                return name
            x -= p
        return None

    def _deliver(self, server: VllmServer, route: str, body: dict | None, delay: float) -> SimThread:
        sched = self.scheduler

        def handle() -> dict:
            if delay:
                sched.sleep(delay, f"{route} in flight to {server.name}")
            me = current().thread
            info = (body or {}).get("init_info") or (body or {}).get("update_info") or {}
            if info.get("epoch") is not None and info["epoch"] < self.newest_epoch():
                self.counts["sent by a coordinator that lost its lease"] += 1
            try:
                answer = server.handle(route, body)
            except RequestError as e:
                me.label = f"{route}{_brief(body)} answered HTTP {e.status}: {str(e)[:160]}"
                raise
            me.label = f"{route}{_brief(body)} answered"
            return answer

        return sched.spawn(server.process, f"{server.name}#{server.life}{route}", handle)

    def call(self, url: str, route: str, body: dict | None = None, method: str = "POST", timeout: float = 600.0) -> dict:
        """``flows.receive.fleet_members.http_call`` over the simulated network."""
        sched = current().scheduler
        sched.point(f"send {route} to {url}")
        server = self.server(url)
        if server is None:
            raise MemberError(f"{url}{route}: [Errno 111] Connection refused")
        fault = self._fault()
        if fault:
            self.counts[fault] += 1
        deadline = sched.now + timeout
        if fault == "lost-request":
            sched.wait_until(lambda: False, f"{route} to {url}: waiting for an answer that never comes", deadline)
            raise MemberError(f"{url}{route}: timed out")
        delay = sched.rng.uniform(0.0, self.faults.max_delay) if fault == "delayed" else 0.0
        handler = self._deliver(server, route, body, delay)
        if fault == "duplicated":
            self._deliver(server, route, body, sched.rng.uniform(0.0, 1.0))
        answered = sched.wait_until(lambda: handler.done or not server.process.alive, f"{route} to {url}: awaiting",
                                    deadline)
        if not answered:
            raise MemberError(f"{url}{route}: timed out")
        if not handler.done:
            raise MemberError(f"{url}{route}: [Errno 104] Connection reset by peer")
        if fault == "lost-response":
            raise MemberError(f"{url}{route}: [Errno 104] Connection reset by peer")
        if isinstance(handler.error, RequestError):
            if TOOK_OVER in str(handler.error):
                self.counts["refused: older epoch"] += 1
            raise MemberError(f"{url}{route}: HTTP {handler.error.status}: {handler.error}", handler.error.status)
        if handler.error is not None:
            raise handler.error
        self.answered(url, route)
        return handler.result


def _brief(body: dict | None) -> str:
    """What a request's body says that a trace needs (its step, epoch, version; not its random ids)."""
    info = (body or {}).get("init_info") or (body or {}).get("update_info") or body or {}
    said = {k: info[k] for k in ("step", "epoch", "weight_version") if info.get(k) is not None}
    return f" {said}" if said else ""
