"""The step table: each refit is a fixed order of steps, written once and run by a ``Runner``.

A ``Step`` is a plain function whose arguments and result are serializable references (ROOT and
step references, plans, manifest entries, file paths, ``LocalRef`` handles of objects that live in
this process), never open files or tensors. A pipeline (``flows.publish.pipeline``,
``flows.receive.pipeline``, ``flows.maintenance.gc``) calls its steps through
``TABLE.bind(runner)``: ``InProcess`` calls them directly (``dcr`` without a Prefect server, the
``Publisher``), ``flows.orchestration.runner.PrefectRunner`` runs each as a Prefect task. A bound table
times every step it runs (``bound.timings``, by task name). Nothing else lists the steps.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True)
class ResultCache:
    """What makes a mapped step's result valid, for a runner that keeps results so that a rerun of
    a failed flow skips the calls that finished (``PrefectRunner``: Prefect's task cache).
    ``key(params)``: a digest of everything the result depends on; ``where(shared)``: the
    directory that keeps the results of one run (its callers' arguments shared by every call);
    ``seconds``: how long a kept result may be used."""

    key: Callable[[dict], str]
    where: Callable[[dict], str]
    seconds: float


@dataclass(frozen=True)
class Step:
    """One step: its task name (shown by Prefect) and its function; ``cache``: for a mapped step
    whose results a rerun can use (see ``ResultCache``), else None."""

    name: str
    fn: Callable[..., Any]
    cache: ResultCache | None = None

    @property
    def key(self) -> str:
        return self.fn.__name__


class Runner(Protocol):
    def wrap(self, step: Step) -> Callable[..., Any]:
        """The callable that runs ``step`` (the function itself, or a task around it)."""


class MappingRunner(Runner, Protocol):
    """A runner that can also map a step over items on workers (``flows.workers``)."""

    mapped: bool  # whether ``map`` sends its tasks to workers
    slots: int  # how many tasks the workers run at once

    def map(self, step: Step, items: list[dict], shared: dict, each: Callable[[Any], None] | None = None) -> list:
        """``step`` called with ``shared`` and each item's arguments, on the workers; results in
        order, each passed to ``each`` once it and those before it are in."""


class StepTable:
    """The steps of one pipeline, in the order they run."""

    def __init__(self, *steps: Step):
        self.steps = {s.key: s for s in steps}
        if len(self.steps) != len(steps) or len({s.name for s in steps}) != len(steps):
            raise ValueError("step keys and names must be unique")

    def __iter__(self):
        return iter(self.steps.values())

    def bind(self, runner: Runner | MappingRunner) -> Bound:
        return Bound(self, runner)


class Bound:
    """A step table bound to a runner: ``bound.plan_publish(...)`` runs that step; ``timings`` holds
    the seconds spent in each step this bound table ran."""

    def __init__(self, table: StepTable, runner: Runner | MappingRunner):
        self._table, self._runner = table, runner
        self._calls: dict[str, Callable[..., Any]] = {}
        self.timings: dict[str, float] = {}

    @property
    def mapped(self) -> bool:
        """Whether ``map`` runs its calls on workers (else in this process, one after another)."""
        return bool(getattr(self._runner, "mapped", False))

    @property
    def slots(self) -> int:
        """How many mapped calls run at once (1 without workers)."""
        return getattr(self._runner, "slots", 1) if self.mapped else 1

    def map(self, key: str, items: list[dict], *, each: Callable[[Any], None] | None = None, **shared) -> list:
        """Step ``key`` called with ``shared`` and each item's arguments: on the runner's workers
        if it has them, else in turn here; results in the items' order, each passed to ``each``
        (if given) as soon as it and those before it are in. Timed as one step."""
        step = self._table.steps[key]
        t0 = time.perf_counter()
        try:
            if self.mapped:
                return self._runner.map(step, items, shared, each)
            call, out = self._runner.wrap(step), []
            for item in items:
                out.append(call(**shared, **item))
                if each is not None:
                    each(out[-1])
            return out
        finally:
            self.timings[step.name] = self.timings.get(step.name, 0.0) + time.perf_counter() - t0

    def __getattr__(self, key: str) -> Callable[..., Any]:
        try:
            step = self._table.steps[key]
        except KeyError:
            raise AttributeError(f"no step {key!r}") from None
        call = self._calls.get(key)
        if call is None:
            call = self._calls[key] = timed(self.timings, step.name, self._runner.wrap(step))
        return call


def timed(timings: dict[str, float], key: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def call(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            timings[key] = timings.get(key, 0.0) + time.perf_counter() - t0

    return call


class InProcess:
    """Runs every step as a plain call in this process."""

    def wrap(self, step: Step) -> Callable[..., Any]:
        return step.fn
