"""The seams a simulated schedule runs the real code through: its ROOT, its clocks, its threads.

- **ROOT** (``SimStore``): a ``storage.backends.base.Backend`` over a dict of objects, under the
  real ``storage.root.Root`` (key checks, counters) that ``open_root`` returns for the schedule's
  ROOT URL (``s3://fleet-sim/root``: a store shared between processes, as a fleet's must be; no
  request ever leaves the process). Each object operation is a scheduling point, then happens at
  once: one event. The published steps are made once by the real publisher (``published``) and
  copied into each schedule's store (a dict copy).
- **Clocks** (``SimClock``, a ``dcr_core.clock.Clock``): the schedule's simulated time, plus a skew
  of the party's own; each read is a scheduling point, a sleep waits for simulated time.
- **Threads**: what the code under test starts on its own is replaced for the duration of a
  schedule (``seams``): the coordinator's pool of member calls (``flows.receive.fleet``'s
  ``ThreadPoolExecutor``: ``SimPool``) and an engine worker's background prepare and record
  (``flows.receive.engine._start``), so that every thread is a simulated one.
- **Progress points** (``dcr_core.events``): every point the code reports (a lease taken, a member
  about to be updated, a record written) is a scheduling point too, and is logged in the trace.

Anything else the code would wait on in real time is kept out of the simulation: the lease is
renewed between the phases only (``renew_in_background=False``: the background renewal runs the
same ``FleetLease.renew`` from a thread that waits on real time), and members are servers (a state
file's lock waits in real time).
"""

from __future__ import annotations

import contextlib
import functools
import posixpath
import time
import types
from collections.abc import Callable, Iterator
from typing import Any

import storage.root
from dcr_bench.fleet_sim.scheduler import Scheduler, current, in_simulation
from dcr_core import events
from storage.backends.base import Backend
from storage.retry import NO_RETRY
from storage.root import Root, RootRef

ROOT_URL = "s3://fleet-sim/root"
EPOCH = 1_800_000_000.0  # the wall clock of simulated time 0 (January 2027)


def point(label: str) -> None:
    """A scheduling point if the caller is a simulated thread; nothing for the driver (the
    invariants read the world between events)."""
    if in_simulation():
        current().scheduler.point(label)


class SimStore(Backend):
    """A schedule's ROOT: objects in a dict (full path -> bytes), each operation one event. It
    counts its changes (``version``) so the invariants re-read ROOT only after one, and calls
    ``on_write(key)`` after each (the world notes when a step's retraction appeared)."""

    shared_between_processes = True
    supports_conditional_create = True

    def __init__(self, path: str, objects: dict[str, bytes], on_write: Callable[[str], None] = lambda key: None):
        super().__init__("s3", None, path)  # type: ignore[arg-type] - no fsspec filesystem behind it
        self.objects = objects
        self.version = 0
        self._prefix = self.path.rstrip("/") + "/"
        self._on_write = on_write

    def _rel(self, path: str) -> str:
        return path[len(self._prefix):] if path.startswith(self._prefix) else path

    def _changed(self, path: str) -> None:
        self.version += 1
        self._on_write(self._rel(path))

    def read(self, path: str, limit: int | None = None) -> bytes:
        point(f"GET {self._rel(path)}")
        try:
            data = self.objects[path]
        except KeyError:
            raise FileNotFoundError(path) from None
        return data if limit is None else data[:limit + 1]

    def read_range(self, path: str, start: int, length: int) -> bytes:
        point(f"GET {self._rel(path)} [{start}:+{length}]")
        try:
            return self.objects[path][start:start + length]
        except KeyError:
            raise FileNotFoundError(path) from None

    def write(self, path: str, data: bytes) -> None:
        point(f"PUT {self._rel(path)}")
        self.objects[path] = bytes(data)
        self._changed(path)

    def create_if_absent(self, path: str, data: bytes) -> bool:
        point(f"PUT-if-absent {self._rel(path)}")
        if path in self.objects:
            return False
        self.objects[path] = bytes(data)
        self._changed(path)
        return True

    def exists(self, path: str) -> bool:
        point(f"HEAD {self._rel(path)}")
        return path in self.objects

    def listdir(self, path: str, prefixes: bool = False) -> list[str]:
        point(f"LIST {self._rel(path)}")
        return self.children(path, prefixes)

    def children(self, path: str, prefixes: bool = False) -> list[str]:
        under = path.rstrip("/") + "/"
        names = set()
        for key in self.objects:
            if key.startswith(under):
                head, sep, _ = key[len(under):].partition("/")
                if sep or not prefixes:
                    names.add(head)
        return sorted(names)

    def find(self, path: str) -> list[tuple[str, int, float | None]]:
        point(f"LIST {self._rel(path)} (recursive)")
        under = path.rstrip("/") + "/"
        return [(k, len(v), None) for k, v in sorted(self.objects.items()) if k.startswith(under)]

    def remove(self, path: str, recursive: bool = False) -> None:
        point(f"DELETE {self._rel(path)}")
        under = path.rstrip("/") + "/"
        doomed = [k for k in self.objects if k == path or (recursive and k.startswith(under))]
        if not doomed:
            raise FileNotFoundError(path)
        for k in doomed:
            del self.objects[k]
        self._changed(path)


class SimRoot(Root):
    """The real ``Root`` over a ``SimStore``: opened without a client (nothing to reach), so its
    ``__init__`` sets what ``Root.__init__`` sets, from the store."""

    def __init__(self, url: str, store: SimStore):  # no client to open: see the class docstring
        self.ref = RootRef(url)
        self.url, self.storage_options = self.ref.url, self.ref.storage_options
        self.backend, self.fs, self.path, self.protocol = store, None, store.path, "s3"
        self.retry = NO_RETRY
        self._bucket_seen = True


@contextlib.contextmanager
def installed_root(store: SimStore, url: str = ROOT_URL) -> Iterator[Root]:
    """``open_root(url)`` is a ``SimRoot`` over ``store`` for the block (every module opens ROOTs
    through ``open_root``, which keeps one ``Root`` per URL and options)."""
    root = SimRoot(url, store)
    key = (root.ref.url, storage.root._options_key({}))
    with storage.root._ROOTS_LOCK:
        storage.root._ROOTS[key] = root
    try:
        yield root
    finally:
        with storage.root._ROOTS_LOCK:
            storage.root._ROOTS.pop(key, None)


def store_path(url: str = ROOT_URL) -> str:
    """The path inside the store that ``url``'s keys are under (as fsspec spells it)."""
    return url.split("://", 1)[1].rstrip("/")


def snapshot(root: Root) -> dict[str, bytes]:
    """Every object of ``root`` by key (what each schedule's store starts from)."""
    prefix = root.path.rstrip("/") + "/"
    return {full[len(prefix):]: root.backend.read(full) for full, _, _ in root.backend.find(root.path)}


def objects_at(path: str, by_key: dict[str, bytes]) -> dict[str, bytes]:
    return {posixpath.join(path, k): v for k, v in by_key.items()}


class SimClock:
    """A party's clock (``dcr_core.clock.Clock``): the schedule's simulated time plus ``skew``
    seconds (its wall clock only: a monotonic clock has no meaning across machines)."""

    def __init__(self, scheduler: Scheduler, skew: float = 0.0):
        self.scheduler, self.skew = scheduler, skew

    def time(self) -> float:
        point("clock")
        return EPOCH + self.scheduler.now + self.skew

    def monotonic(self) -> float:
        point("clock")
        return 1000.0 + self.scheduler.now

    def sleep(self, seconds: float) -> None:
        self.scheduler.sleep(seconds, f"sleep {seconds:.3f} s")


class SimPool:
    """``concurrent.futures.ThreadPoolExecutor`` as ``flows.receive.fleet._each`` uses it: each item
    in a simulated thread of the caller's process, ``map`` waiting for them all."""

    def __init__(self, max_workers: int | None = None, **_: Any):
        self._me = current()

    def __enter__(self) -> SimPool:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def map(self, fn: Callable[[Any], Any], items) -> list[Any]:
        sched, parent = self._me.scheduler, self._me.thread
        workers = [sched.spawn(parent.process, f"{parent.name}.{i}", functools.partial(fn, item))
                   for i, item in enumerate(items)]
        sched.wait_until(lambda: all(w.done for w in workers), "await its member calls")
        for w in workers:
            if w.error is not None:
                raise w.error
        return [w.result for w in workers]


def spawn_here(name: str, fn: Callable[[], Any]) -> tuple[Any, dict[str, Any]]:
    """``flows.receive.engine._start`` in the simulation: ``fn`` in a simulated thread of the
    caller's process; the thread (its ``join`` waits as a simulated thread) and the box of its
    result or error."""
    me = current()
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["result"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to whoever joins (as engine._start does)
            box["error"] = e

    return me.scheduler.spawn(me.thread.process, f"{me.thread.process.name}:{name}", run), box


@contextlib.contextmanager
def replaced(obj: object, **attrs: Any) -> Iterator[None]:
    """``obj``'s attributes set to ``attrs`` for the block, then put back."""
    old = {k: getattr(obj, k) for k in attrs}
    for k, v in attrs.items():
        setattr(obj, k, v)
    try:
        yield
    finally:
        for k, v in old.items():
            setattr(obj, k, v)


@contextlib.contextmanager
def progress_points(on_point: Callable[[str, dict], None]) -> Iterator[None]:
    """Every progress point a simulated thread reaches is a scheduling point, after ``on_point``
    noted it."""
    def listener(name: str, fields: dict) -> None:
        if in_simulation():
            on_point(name, fields)
            current().scheduler.point(name)

    with events.listening(listener):
        yield


@contextlib.contextmanager
def process_caches(scheduler: Scheduler) -> Iterator[None]:
    """What the code under test keeps per process across calls, emptied before and after each
    schedule (a schedule replays the same whatever ran before it in this process): the manifests
    read (``storage.catalog``, by ROOT, step and digest), and the ROOT's run document
    (``storage.run_identity``: read again after ``CACHE_SECONDS`` of its monotonic clock, here the
    simulated one). The simulated parties share them, as the threads of one process do: a manifest
    is content-addressed, so which party read it first changes how many reads there are, nothing
    else."""
    from storage import catalog, run_identity

    def empty() -> None:
        run_identity._seen.clear()
        with catalog._MANIFESTS_LOCK:
            catalog._MANIFESTS.clear()

    clock = types.SimpleNamespace(monotonic=lambda: 1000.0 + scheduler.now, time=time.time)
    empty()
    try:
        with replaced(run_identity, time=clock):
            yield
    finally:
        empty()


@contextlib.contextmanager
def fleet_pool() -> Iterator[None]:
    """The coordinator's pool of member calls (``flows.receive.fleet``) made of simulated threads."""
    from flows.receive import fleet

    with replaced(fleet, ThreadPoolExecutor=SimPool):
        yield
