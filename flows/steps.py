"""The step tables: each refit is a fixed order of steps, written once and run by a ``Runner``.

A ``Step`` is a plain function whose arguments and result are serializable references (ROOT and
step references, plans, manifest entries, file paths, ``LocalRef`` handles of objects that live in
this process), never open files or tensors. A pipeline's steps are the attributes of one
``StepTable`` class, each named after its function (its task name too: ``plan_receive`` runs as
``plan-receive``)::

    class StateSteps(StepTable):
        plan_receive = Step(state_file.plan_receive)
        ...

    tasks = StateSteps(runner)
    plan = tasks.plan_receive(ref, path, step)   # the function's own signature, checked

An instance runs its steps with a runner: ``InProcess`` calls them directly (``dcr`` without a
Prefect server, the ``Publisher``), ``flows.orchestration.runner.PrefectRunner`` runs each as a Prefect
task. Reading a step off an instance gives a callable typed as the function itself (``Step`` is a
descriptor generic in the function's parameters and result), so type checkers and editors see every
call site and its arguments. An instance times every step it runs (``tasks.timings``, by task
name). Nothing else lists the steps.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, ParamSpec, Protocol, TypeVar, cast, overload

P = ParamSpec("P")
R = TypeVar("R")


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
class Step(Generic[P, R]):
    """One step: its function, and ``cache`` for a mapped step whose results a rerun can use (see
    ``ResultCache``). Its key is the function's name and its task name that name with hyphens
    (``plan_receive``: ``plan-receive``). As an attribute of a ``StepTable`` it must be named
    after its function; read off a table instance it is the function, run by the table's runner."""

    fn: Callable[P, R]
    cache: ResultCache | None = None

    @property
    def key(self) -> str:
        return self.fn.__name__

    @property
    def name(self) -> str:
        return self.fn.__name__.replace("_", "-")

    def __set_name__(self, owner: type, attr: str) -> None:
        if attr != self.key:
            raise TypeError(f"{owner.__name__}.{attr} runs {self.key}: a step is named after its function")

    @overload
    def __get__(self, table: None, owner: type | None = None) -> Step[P, R]: ...

    @overload
    def __get__(self, table: StepTable, owner: type | None = None) -> Callable[P, R]: ...

    def __get__(self, table: StepTable | None, owner: type | None = None) -> Step[P, R] | Callable[P, R]:
        return self if table is None else table.call(self)


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
    """The steps of one pipeline, as class attributes in the order they run; an instance runs them
    with ``runner`` (default ``InProcess``) and holds ``timings``: the seconds spent in each step
    it ran, by task name."""

    def __init__(self, runner: Runner | MappingRunner | None = None):
        self._runner = runner if runner is not None else InProcess()
        self._calls: dict[Step, Callable[..., Any]] = {}
        self.timings: dict[str, float] = {}

    @classmethod
    def steps(cls) -> dict[str, Step]:
        """Key -> step, in the order the table (and the tables it extends) declares them."""
        out: dict[str, Step] = {}
        for klass in reversed(cls.__mro__):
            out.update({k: v for k, v in vars(klass).items() if isinstance(v, Step)})
        return out

    def call(self, step: Step[P, R]) -> Callable[P, R]:
        """``step`` as this table runs it: through the runner, timed under its task name."""
        call = self._calls.get(step)
        if call is None:
            call = self._calls[step] = timed(self.timings, step.name, self._runner.wrap(step), step.fn)
        return call

    @property
    def mapped(self) -> bool:
        """Whether ``map`` runs its calls on workers (else in this process, one after another)."""
        return bool(getattr(self._runner, "mapped", False))

    @property
    def slots(self) -> int:
        """How many mapped calls run at once (1 without workers)."""
        return getattr(self._runner, "slots", 1) if self.mapped else 1

    def map(self, fn: Callable[..., R], items: list[dict], *, each: Callable[[R], None] | None = None,
            **shared: Any) -> list[R]:
        """The step of function ``fn`` called with ``shared`` and each item's arguments: on the
        runner's workers if it has them, else in turn here; results in the items' order, each passed
        to ``each`` (if given) as soon as it and those before it are in. Timed as one step."""
        step = self.steps().get(fn.__name__)
        if step is None:
            raise AttributeError(f"{type(self).__name__} has no step {fn.__name__!r}")
        t0 = time.perf_counter()
        try:
            if self.mapped:
                return cast(MappingRunner, self._runner).map(step, items, shared, each)
            call, out = self._runner.wrap(step), []
            for item in items:
                out.append(call(**shared, **item))
                if each is not None:
                    each(out[-1])
            return out
        finally:
            self.timings[step.name] = self.timings.get(step.name, 0.0) + time.perf_counter() - t0


def timed(timings: dict[str, float], key: str, fn: Callable[P, R], like: Callable[..., Any] | None = None) -> Callable[P, R]:
    """``fn``, adding the seconds each call takes to ``timings[key]``; it reads as ``like`` (name,
    signature, docstring: what editors and ``inspect`` show)."""
    @functools.wraps(like or fn)
    def call(*args: P.args, **kwargs: P.kwargs) -> R:
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
