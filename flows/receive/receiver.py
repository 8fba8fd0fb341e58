"""Every kind of receiver behind one interface, and the registry that picks the kind of a target.

A receiver is a target DCR brings to a step: a state file, a live torch module, an inference
engine in this process, a server that ``dcr fleet`` switches. Each kind is one ``Receiver``
subclass, and a refit runs the same lifecycle on every kind, in this order:

============  =========================================================================================
``bind``      the ROOT, the receiver's id and options, and who drives the refit (``Binding``)
``prepare``   plan, lease the steps it reads, stage the step beside the target and verify it; the
              target is not touched, and keeps serving (``stage``)
``pause``     the target stops serving (a kind that serves; nothing for the others)
``apply``     the pause window: the staged step put in place; a failure leaves the target at its
              previous step, bit for bit, or says that it could not (``install``)
``resume``    the target serves again
``record``    the receiver's commit recorded in ROOT (``flows.receive.records.ReceiverCommit``)
``release``   leases, locks and whatever was staged but not applied dropped; after success or
              failure alike
============  =========================================================================================

``refit(step)`` runs them once, for ``dcr receive`` and ``receive_refit``; ``dcr fleet``
(``flows.receive.fleet``) runs each phase on every member at once, all or nothing. A kind
implements ``version``, ``stage``, ``install``, ``record`` and ``release`` (``pause``, ``resume``
if it serves; ``result`` if it refits on its own). ``admit`` is the one check every request passes,
whatever the kind: ``bind``, ``prepare`` and ``apply`` call it before anything is planned or
changed, so a receiver that must refuse a caller (a coordinator that is no longer the one in
charge, say, or a server that must not be sent the ROOT's credentials) refuses there, once for
every kind. A coordinator of many receivers (``dcr fleet``) also asks each for its ``identity``
(what names the target itself, whatever spelling named it: the same target twice is refused) and
has each ``hold`` what it must hold alone (a state file's lock) before the refit starts, in the
order of their identities: two coordinators over the same targets then never wait on each other
in a cycle, and each wait is bounded.

Fencing, the same for every kind: a coordinator's binding carries its fleet's name
(``coordinator``) and the epoch of its lease (``epoch``, ``storage.fleet_lease``), and ``admit``
refuses a binding whose epoch is older than the highest this receiver has seen for that fleet
(``FencedError``: "fleet NAME epoch E is older than epoch F this member has seen: another
coordinator took over"), and otherwise remembers it (``fence``). So once a newer coordinator
reached a member, one that lost its lease (paused, partitioned, slow) can no longer change it. A
binding of no coordinator at all (a ``dcr receive``, a hand-made update) is refused while a fleet
the receiver has seen is being switched in its ROOT (``outside_fleets``: that fleet's lease held).
Where the highest epochs are kept is the kind's (``fence``): by default in the receiver object
(``Epochs``), which suits a receiver that lives as long as its target (the ``dcr`` backend inside
a vLLM server or an in-process ``LLM``: a restarted server forgets, which is safe because it starts
over from its checkpoint directory and is reloaded whole); a state file keeps them beside the file,
under its lock (``flows.receive.pipeline.StateFile``), so a fence holds across processes.

The registry (``KINDS``, extended by ``register``) says which kind a target is, and imports the
kind's module only then (a kind's module may import torch or vLLM; the state file's imports
neither): by the scheme of a URL (``state:PATH``, ``http(s)://HOST:PORT``, ``local:NAME``), a
plain path (a state file), or, for an object of this process, by asking each in-process kind in
turn whether the object is one of its (``holds``: the only place DCR tells a vLLM engine from a
torch module). Nothing outside the registry tests a target's type or a URL's prefix.
"""

from __future__ import annotations

import importlib
import os
import re
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from dcr_core.errors import BusyError, DCRError, FencedError, UsageError
from flows.options import ReceiveOptions
from flows.results import ReceiveResult, as_dict
from storage import fleet_lease, layout, signing
from storage.root import RootRef, open_root


@dataclass(frozen=True)
class Binding:
    """What a refit is for: ``root`` (the ROOT read, with its storage options), ``receiver_id``
    (the receiver's records, leases and reports in ROOT), ``options``, ``mirror`` (where a live
    target keeps the canonical copy of what it holds; None: DCR's cache directory) and
    ``coordinator`` (who drives the refit: None for the receiver itself, the fleet's name under
    ``dcr fleet``) and ``epoch`` (the fleet coordinator's lease epoch, which fences: see the
    module docstring; None: not fenced)."""

    root: RootRef
    receiver_id: str
    options: ReceiveOptions = field(default_factory=ReceiveOptions)
    mirror: str | None = None
    coordinator: str | None = None
    epoch: int | None = None

    def __post_init__(self) -> None:
        if self.epoch is not None:
            check_fence(self.coordinator, self.epoch)


TOOK_OVER = "another coordinator took over"


def check_fence(fleet: str | None, epoch: int) -> None:
    """A fleet's name and a lease epoch, as a fence takes them (else a one-line ``UsageError``)."""
    if fleet is None:
        raise UsageError(f"epoch {epoch!r} given without the fleet it belongs to")
    layout.fleet_key(fleet)
    if isinstance(epoch, bool) or not isinstance(epoch, int) or not 1 <= epoch <= layout.MAX_STEP:
        raise UsageError(f"fleet {fleet}: epoch must be an integer in 1..{layout.MAX_STEP}, got {epoch!r}")


def fenced(seen: Mapping[str, int], fleet: str, epoch: int) -> dict[str, int] | None:
    """The fencing rule, once for every kind: ``seen`` (the highest epoch seen per fleet) with
    ``epoch`` recorded for ``fleet`` if it is newer (None: nothing newer to record), or
    ``FencedError`` if it is older than the one seen."""
    highest = seen.get(fleet)
    if highest is not None and epoch < highest:
        raise FencedError(f"fleet {fleet} epoch {epoch} is older than epoch {highest} this member has seen: {TOOK_OVER}")
    return None if highest == epoch else {**seen, fleet: epoch}


class Epochs:
    """The highest fleet epoch a receiver has seen, per fleet, in memory (thread-safe): what
    ``Receiver.fence`` keeps by default."""

    def __init__(self) -> None:
        self._seen: dict[str, int] = {}
        self._lock = threading.Lock()

    def admit(self, fleet: str, epoch: int) -> None:
        with self._lock:
            newer = fenced(self._seen, fleet, epoch)
            if newer is not None:
                self._seen = newer

    def highest(self, fleet: str) -> int | None:
        with self._lock:
            return self._seen.get(fleet)

    def seen(self) -> dict[str, int]:
        with self._lock:
            return dict(self._seen)


def outside_fleets(name: str, seen: Mapping[str, int], root: RootRef) -> None:
    """Refuse (``BusyError``, one line) a change that no fleet coordinator makes to ``name``, a
    member of the fleets ``seen`` (the highest epoch it has seen of each), while one of those fleets
    is being switched in ROOT (its lease held, ``storage.fleet_lease``): that change would race the
    coordinator's switch and leave the fleet's record untrue. A fleet no one is switching lets it
    through: the next switch asks every member its step."""
    if not seen:
        return
    r = open_root(root)
    now = time.time()
    for fleet in sorted(seen):
        epoch, rec = fleet_lease.newest(r, fleet)
        if fleet_lease.is_held(rec, now):
            raise BusyError(f"{name}: a member of fleet {fleet}, which {rec.holder.describe()} is switching "
                            f"(lease epoch {epoch}, until {fleet_lease.utc(rec.expires_at)}): a change outside "
                            "the fleet would race it and leave its record untrue; retry once it is done, "
                            "or switch the member with dcr fleet")


def check_arguments(receiver_id: str | None, step: int | None, options: Any) -> ReceiveOptions:
    """A refit's receiver id and step checked (one line naming what is wrong), and its options."""
    if receiver_id is not None:
        layout.check_receiver(receiver_id)
    if step is not None:
        layout.check_step(step)
    if options is not None and not isinstance(options, ReceiveOptions):
        raise UsageError(f"options must be a ReceiveOptions, got {type(options).__name__}")
    if options is not None and options.require_signed:  # before anything is read
        signing.check_verifiable(f"receiver {receiver_id}" if receiver_id else "receive", "--require-signed")
    return options or ReceiveOptions()


class Receiver(ABC):
    """One receiver (see the module docstring for the lifecycle). ``name``: how messages name it
    (its URL, path or type)."""

    def __init__(self, name: str):
        self.name = name
        self._binding: Binding | None = None
        self.epochs = Epochs()

    # -- the lifecycle, the same for every kind ------------------------------------------------------

    @property
    def binding(self) -> Binding:
        if self._binding is None:
            raise UsageError(f"{self.name}: no ROOT bound: bind it first")
        return self._binding

    def bind(self, binding: Binding) -> None:
        """Bind the receiver to a ROOT and an id (a fresh binding replaces the last one)."""
        self.admit(binding)
        self._binding = binding

    def admit(self, binding: Binding) -> None:
        """Accept requests made under ``binding``, or raise: the one check every request passes
        before anything is planned or changed (``bind``, ``prepare``, ``apply``), whatever the
        kind (a server refuses a ROOT whose storage options hold a credential). The base refuses
        a fleet epoch older than one seen (``fence``); a kind that refuses more calls it too."""
        if binding.epoch is not None and binding.coordinator is not None:
            self.fence(binding.coordinator, binding.epoch)
        elif binding.coordinator is None:  # no fleet's request: not while a fleet it belongs to switches
            outside_fleets(self.name, self.seen_fleets(), binding.root)

    def seen_fleets(self) -> dict[str, int]:
        """The highest epoch this receiver has seen of each fleet (what ``fence`` keeps)."""
        return self.epochs.seen()

    def fence(self, fleet: str, epoch: int) -> None:
        """Refuse (``FencedError``) a request of fleet ``fleet`` made at ``epoch`` if it is older
        than the highest epoch this receiver has seen for that fleet; remember it if newer. The
        base keeps them in this object (``epochs``); a kind whose target outlives the process
        keeps them with the target (see the module docstring)."""
        self.epochs.admit(fleet, epoch)

    @property
    def identity(self) -> str:
        """What names the target itself, whatever URL or path named it (a state file: its real
        path): a fleet refuses one target named twice, and holds its members in this order."""
        return self.name

    def hold(self, timeout: float | None = None) -> None:
        """Take what a refit of this receiver holds alone (a state file's lock) until ``release``,
        waiting at most ``timeout`` seconds (None: as long as it takes; ``BusyError`` past it).
        ``prepare`` takes it too, if not held yet; a kind that holds nothing does nothing."""
        return None  # a kind with nothing to hold here (a server keeps its own update exclusive)

    def prepare(self, step: int | None = None) -> None:
        """Phase 1: plan, lease and stage ``step`` (default: the latest), verified; the target is untouched."""
        self.admit(self.binding)
        self.stage(step)

    def apply(self, step: int | None = None) -> None:
        """Phase 2, the pause window: put ``step`` in place (default: the step prepared; another
        step is prepared first)."""
        self.admit(self.binding)
        self.install(step)

    def pause(self) -> None:
        """Stop serving before ``apply`` (a kind that serves requests)."""
        return None  # a target that serves nothing has nothing to stop

    def resume(self) -> None:
        """Serve again after ``apply``, whether it succeeded or not."""
        return None  # a target that serves nothing has nothing to resume

    def refit(self, step: int | None = None) -> ReceiveResult:
        """Bring the bound target to ``step`` (default: the latest) at once: prepare, pause, apply,
        resume, record, and release whatever happened."""
        try:
            self.prepare(step)
            self.pause()
            try:
                self.apply(step)
            finally:
                self.resume()
            self.record()
        finally:
            self.release()
        return self.result()

    # -- what each kind implements -------------------------------------------------------------------

    @abstractmethod
    def version(self) -> int | None:
        """The step the target holds now (None: unknown, or none)."""

    @property
    def vouched(self) -> bool:
        """Whether what ``version`` says can be believed now; False (a kind whose version can lag
        its target: ``flows.receive.fleet_members``): a fleet applies the step to it even where it
        says it holds it, so that it says so again with certainty."""
        return True

    @abstractmethod
    def stage(self, step: int | None) -> None:
        """Phase 1's work (see ``prepare``)."""

    @abstractmethod
    def install(self, step: int | None) -> None:
        """Phase 2's work (see ``apply``)."""

    @abstractmethod
    def record(self) -> None:
        """Record the receiver's commit of the step applied."""

    @abstractmethod
    def release(self) -> None:
        """Drop leases, locks, and what was staged but not applied; safe to call at any time."""

    def bytes_pulled(self) -> int | None:
        """The bytes the last prepare and apply pulled from ROOT (None: not known here)."""
        try:
            return self.result().bytes_pulled
        except DCRError:
            return None

    def result(self) -> ReceiveResult:
        """What the last ``refit`` did."""
        raise UsageError(f"{self.name}: a {type(self).__name__} is refitted by dcr fleet, not on its own")

    # -- how the registry makes one ------------------------------------------------------------------

    @classmethod
    def from_url(cls, url: str, **how: Any) -> Receiver:
        """The receiver a URL of this kind names (``how``: what its caller decides, e.g. ``timeout``)."""
        raise UsageError(f"{url}: a {cls.__name__} is not named by a URL")

    @classmethod
    def from_target(cls, target: Any, **how: Any) -> Receiver:
        """The receiver of ``target``, a path or an object of this process (``how``: ``runner``, ...)."""
        raise UsageError(f"{cls.__name__} takes no target of type {type(target).__name__}")

    @classmethod
    def canonical(cls, url: str) -> tuple[str, str]:
        """``url`` as a fleet names the member (the same member from any directory), and the default
        receiver id's suffix (``dcr fleet`` prefixes the fleet's name). ``UsageError`` if it is not
        a well-formed URL of this kind."""
        return url, url.partition(":")[2]


# -- the registry ------------------------------------------------------------------------------------


def _has_method(name: str) -> Callable[[object], bool]:
    return lambda obj: callable(getattr(obj, name, None))


@dataclass(frozen=True)
class Kind:
    """A receiver kind in the registry: its class (``module``, ``cls``: imported on first use), how
    a target of it is written (``form``, for messages), the URL ``schemes`` that name one, whether a
    plain path does (``paths``), and for an object of this process whether it is one (``holds``)."""

    name: str
    module: str
    cls: str
    form: str
    schemes: tuple[str, ...] = ()
    paths: bool = False
    holds: Callable[[object], bool] | None = None

    @property
    def in_process(self) -> bool:
        """Whether its targets are objects of this process (not named by a path or URL)."""
        return self.holds is not None

    def load(self) -> type[Receiver]:
        return getattr(importlib.import_module(self.module), self.cls)


KINDS: list[Kind] = [
    Kind("http-server", "flows.receive.fleet_members", "HttpServer", "http://HOST:PORT", schemes=("http", "https")),
    Kind("state-file", "flows.receive.pipeline", "StateFile", "state:PATH", schemes=("state",), paths=True),
    Kind("local-engine", "flows.receive.fleet_members", "LocalEngine", "local:NAME", schemes=("local",)),
    # objects of this process, asked in this order: an engine first (it has no load_weights of its own)
    Kind("vllm-engine", "flows.receive.vllm_refit", "VllmEngine", "a vLLM LLM started with DCR's worker extension",
         holds=_has_method("collective_rpc")),
    Kind("live-module", "flows.receive.module_pipeline", "LiveModule", "a torch module with load_weights(weights)",
         holds=_has_method("load_weights")),
]
_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*):")


def register(kind: Kind) -> None:
    """Add a receiver kind (its schemes must be new; in-process kinds are asked after the others)."""
    taken = {s for k in KINDS for s in k.schemes}
    if taken & set(kind.schemes) or any(k.name == kind.name for k in KINDS):
        raise ValueError(f"receiver kind {kind.name}: its name or a scheme of {kind.schemes} is registered already")
    KINDS.append(kind)


def scheme_of(url: str) -> str | None:
    """The scheme ``url`` starts with (``state``, ``http``, ...), or None."""
    m = _SCHEME.match(url)
    return m.group(1).lower() if m else None


def url_schemes() -> set[str]:
    """Every scheme a registered kind answers."""
    return {s for k in KINDS for s in k.schemes}


def _either(forms: list[str]) -> str:
    return forms[0] if len(forms) == 1 else f"{', '.join(forms[:-1])} or {forms[-1]}"


def url_forms() -> str:
    """How the kinds named by a URL are written: ``http://HOST:PORT, state:PATH or local:NAME``."""
    return _either([k.form for k in KINDS if k.schemes])


def kind_of_url(url: str) -> Kind:
    """The kind whose scheme ``url`` has; else a one-line ``UsageError`` naming it."""
    scheme = scheme_of(url)
    for k in KINDS:
        if scheme is not None and scheme in k.schemes:
            return k
    what = "no scheme" if scheme is None else f"no receiver kind for scheme {scheme!r}"
    raise UsageError(f"{url!r}: {what} (expected {url_forms()})")


def kind_of(target: Any) -> Kind:
    """The kind of a refit's ``target``: a path (``str`` or ``os.PathLike``) is a state file; an
    object of this process is asked of each in-process kind in turn."""
    if isinstance(target, (str, os.PathLike)):
        return next(k for k in KINDS if k.paths)
    for k in KINDS:
        if k.holds is not None and k.holds(target):
            return k
    raise UsageError(f"{type(target).__name__} is not a receiver: expected a state file path or "
                     f"{_either([k.form for k in KINDS if k.holds is not None])}")


def holds(target: Any, cls: type[Receiver]) -> bool:
    """Whether ``target``, an object of this process, is one the kind of class ``cls`` refits."""
    kind = next((k for k in KINDS if k.cls == cls.__name__ and k.module == cls.__module__), None)
    return kind is not None and kind.holds is not None and kind.holds(target)


def member(url: str, **how: Any) -> Receiver:
    """The receiver a fleet member's URL names (see ``kind_of_url``)."""
    return kind_of_url(url).load().from_url(url, **how)


def receiver_of(target: Any, **how: Any) -> Receiver:
    """The receiver of a refit's target (see ``kind_of``)."""
    return kind_of(target).load().from_target(target, **how)


def refit(target: Any, root: str | os.PathLike, receiver_id: str, step: int | None = None,
          storage_options: dict | None = None, options: ReceiveOptions | None = None, mirror: str | None = None,
          **how: Any) -> dict:
    """Bring ``target`` (any kind: ``kind_of``) to ``step`` (default: the latest) of ``root`` through
    its kind's lifecycle; ``mirror``: where a live target keeps its mirror; ``how``: what its kind
    takes (``runner``). Returns its ``ReceiveResult`` as one flat dict."""
    receiver = receiver_of(target, **how)
    options = check_arguments(receiver_id, step, options)
    receiver.bind(Binding(RootRef(os.fspath(root), dict(storage_options or {})), receiver_id, options, mirror=mirror))
    return as_dict(receiver.refit(step))
