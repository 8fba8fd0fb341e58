"""Fleet members reached through vLLM's weight-transfer API: a server over HTTP, an ``LLM`` in this process.

vLLM 0.32's weight-transfer API (with the ``dcr`` backend, ``flows.receive.vllm_transfer``, on the
member's side) is ``init_weight_transfer_engine`` (with ``prepare``: the member pulls and verifies
the step into a staged mirror while it serves), ``start_weight_update`` (waits for that prepare,
raises what it failed with), ``update_weights`` (the pause window), ``finish_weight_update`` (with a
version: done, and the member records its commit in the background; without one after a start:
what was staged is dropped), around vLLM's ``pause`` and ``resume``, and the weight version. The
two receiver kinds here speak it and nothing else:

- ``HttpServer`` (``http://HOST:PORT``, ``https://...``): an OpenAI-compatible vLLM server in dev
  mode (``VLLM_SERVER_DEV_MODE=1``), its routes (``vllm.entrypoints.rl.online.api_router``):
  ``/weight_info``, ``/init_weight_transfer_engine``, ``/start_weight_update``, ``/update_weights``,
  ``/finish_weight_update``, ``/pause``, ``/resume``;
- ``LocalEngine`` (``local:NAME``): a vLLM ``LLM`` in this process, started with
  ``weight_transfer_config={"backend": "dcr"}`` and registered by ``register_fleet_engine(NAME,
  llm)``: the calls go to the LLM's own weight-transfer methods; resume resets its prefix cache.
  Python only (``flows.run_fleet``): a command line has no ``LLM`` to register.

A failed call raises ``MemberError`` naming the member and the call; ``status`` is what the member
answered (None: no answer). Under ``dcr fleet`` the ``init_info`` and the ``update_info`` carry the
fleet's name and the coordinator's lease epoch (``"fleet"``, ``"epoch"``): the member's backend
keeps the highest and refuses older ones (``flows.receive.vllm_transfer``). A server's requests go
through ``call`` (``http_call``: one JSON request), a seam where a test or a simulation puts a
transport of its own.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import urllib.error
import urllib.parse
import urllib.request
import uuid
from abc import abstractmethod
from collections.abc import Callable
from typing import Any

from dcr_core.clock import SYSTEM, Clock
from dcr_core.errors import UsageError
from flows.receive.receiver import Binding, Receiver
from storage import credentials, layout
from storage.catalog import Catalog
from storage.root import RootRef, open_root

log = logging.getLogger("dcr.fleet")
HTTP_TIMEOUT = 600.0
VERSION_TIMEOUT = 30.0  # asking a member its version: it answers at once, or is not serving


class MemberError(ConnectionError):
    """A request to a member failed: ``status`` is the HTTP status it answered with (None: no answer)."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


def http_call(url: str, route: str, body: dict | None = None, method: str = "POST",
              timeout: float = HTTP_TIMEOUT) -> dict:
    """One JSON request to a member; any failure raises ``MemberError`` naming the member and
    route, with what the server said."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url + route, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw = r.read()
    except urllib.error.HTTPError as e:
        said = e.read()[:300].decode(errors="replace").replace("\n", " ")
        raise MemberError(f"{url}{route}: HTTP {e.code}: {said}", e.code) from None
    except (urllib.error.URLError, OSError) as e:
        raise MemberError(f"{url}{route}: {getattr(e, 'reason', e)}") from None
    return json.loads(raw) if raw else {}


_UNSEEN = object()


def _step(version: Any) -> int | None:
    """A weight version as a step (None: not one DCR set, such as vLLM's default)."""
    return int(version) if isinstance(version, str) and version.isdigit() else None


class _WeightTransfer(Receiver):
    """The lifecycle over vLLM's weight-transfer calls, which each kind makes its own way (the
    methods ``_init`` to ``_resume``). An update session is opened by the prepare's start (or, to
    take a member back, by the apply itself) and closed by ``record`` (finished with the version)
    or ``release`` (without one).

    vLLM's weight version is what a member says it serves, and it is set only by a finish that
    names one: after an update it lags the weights until then, and a finish from elsewhere (a
    coordinator that lost its lease, a request that arrived late) sets its own, unchecked. So what
    ``version`` says is believed only where this switch can vouch for it (``_unsure`` otherwise: the
    step unknown): after an update, only once this switch's own finish named its step; when an
    update or finish of this switch went unanswered, or a finish of it was refused, or the member
    had an update session left open, or it did not answer this switch's init (so it may not have
    seen its epoch: a coordinator that lost its lease can still move it), or its prepare reported
    holding another step than its version said (a server's ``prepared/<receiver>.json``, ``held``: None when DCR does not know what its
    engine holds, as after a restart), never; and the version must still be the one this switch
    set, or the one it found when it first asked."""

    def __init__(self, url: str):
        super().__init__(url)
        self.url = url
        self._open = False  # an update session is open (started, not finished)
        self._applied: int | None = None
        self._unsure = False  # its version may not be the step it serves (see the class docstring)
        self._admitted = False  # it answered this switch's init: it has seen (and keeps) its epoch
        self._expected: Any = _UNSEEN  # the version it should say: as first asked, then as this switch set it
        self._pulled: int | None = None  # bytes its last prepare pulled, as it reported them (None: unknown)

    # -- the calls -------------------------------------------------------------------------------

    @abstractmethod
    def _weight_version(self) -> Any: ...

    @abstractmethod
    def _init(self, init_info: dict) -> None: ...

    @abstractmethod
    def _start(self) -> None: ...

    @abstractmethod
    def _update(self, update_info: dict) -> None: ...

    @abstractmethod
    def _finish(self, version: str | None) -> None: ...

    def _fence(self) -> dict:
        """The fleet's name and the coordinator's epoch, for every request that changes the member."""
        b = self.binding
        return {} if b.epoch is None else {"fleet": b.coordinator, "epoch": b.epoch}

    def _init_info(self, step: int | None) -> dict:
        b = self.binding
        return {"root": b.root.url, "receiver_id": b.receiver_id, "storage_options": dict(b.root.storage_options),
                "prepare": True, "step": step, "prepare_id": uuid.uuid4().hex, **self._fence()}

    def _prepared(self, init_info: dict) -> None:
        """Between the init and the start: a server's prepare report awaited."""
        return None

    def _reports(self, prepare_id: str) -> list[dict]:
        """This prepare's reports in ROOT, read once the start returned (the prepare is over then)."""
        return prepare_reports(Catalog(open_root(self.binding.root)), self.binding.receiver_id, prepare_id)

    def bytes_pulled(self) -> int | None:
        return self._pulled

    # -- the lifecycle ---------------------------------------------------------------------------

    def version(self) -> int | None:
        said = self._weight_version()
        if self._expected is _UNSEEN:
            self._expected = said
        if self._unsure or said != self._expected:
            return None  # set by someone else since this switch first asked, or behind the weights
        if self._binding is not None and self._binding.epoch is not None and not self._admitted:
            return None  # it may not have seen this switch's epoch: an older coordinator can still move it
        return _step(said)

    @property
    def vouched(self) -> bool:
        return not self._unsure

    def stage(self, step: int | None) -> None:
        init = self._init_info(step)
        self._pulled = None
        for attempt in (1, 2):
            self._init(init)
            self._admitted = True
            self._prepared(init)
            try:
                self._start()  # returns once staged and verified
                self._open = True
                if self._pulled is None:
                    self._pulled = _pulled(self._reports(init["prepare_id"]))
                return
            except MemberError as e:
                if e.status is None or attempt == 2:
                    raise
            # vLLM refuses a start while an update is open: a coordinator that died after its prepare
            # left one. Finishing it without an update drops what it held; then prepare again, once.
            # If there was one (the finish is taken), an update may have run in it, its finish never
            # sent: the version may lag the weights.
            with contextlib.suppress(MemberError):
                self._finish(None)
                self._unsure = True

    def install(self, step: int | None) -> None:
        if not self._open:  # taken back (nothing prepared): the update pulls the step in the pause
            self._pulled = None  # (what it pulls then is in its receiver record, not known here)
            self._start()
            self._open = True
        try:
            self._update({"step": step, **self._fence()})
        except MemberError as e:
            if e.status is None:
                self._unsure = True  # no answer: it may have applied, with its version as it was
            else:  # refused or failed (the engine put itself back): vLLM ended the session (a fenced
                self._open = False  # one is a newer coordinator's now: left alone)
            raise
        self._unsure = True  # the weights are at the step; the version, once record() names it
        self._applied = step

    def record(self) -> None:
        self._open = False  # finished with the version: the member records its commit itself
        self._finish(str(self._applied))  # refused (another finish ended the session) or unanswered: still unsure
        self._expected, self._unsure = str(self._applied), False

    def release(self) -> None:
        if self._open:  # started, never updated: what it staged is dropped
            self._open = False
            try:
                self._finish(None)
            except MemberError:
                self._unsure = True  # another finish may have ended the session first, naming its own version
                raise


class HttpServer(_WeightTransfer):
    """An OpenAI-compatible vLLM server with the ``dcr`` weight-transfer backend, over HTTP (see the
    module docstring). Its prepare runs in the server while it serves: the coordinator waits for
    the server's report in ROOT (``await_prepared``) before the start call, which would otherwise
    wait in the server's engine loop, where it generates nothing.

    A server opens ROOT itself, with credentials from its own environment: its ``init_info`` holds
    the ROOT (a local path made absolute: the server must see the same directory under that path)
    and the storage options, and ``admit`` refuses a binding whose options hold a credential
    (``storage.credentials``) or whose ROOT only this process sees."""

    def __init__(self, url: str, timeout: float = HTTP_TIMEOUT, call: Callable[..., dict] | None = None,
                 clock: Clock = SYSTEM):
        super().__init__(url)
        self.timeout = timeout
        self.call = call or http_call  # (url, route, body, method=, timeout=) -> dict; raises MemberError
        self.clock = clock  # the prepare report's wait
        self._reported: str | None = None  # the prepare id of this switch's report, once it came

    @classmethod
    def from_url(cls, url: str, timeout: float = HTTP_TIMEOUT, call: Callable[..., dict] | None = None,
                 clock: Clock = SYSTEM, **how) -> HttpServer:
        return cls(url, timeout, call, clock)

    @classmethod
    def canonical(cls, url: str) -> tuple[str, str]:
        u = urllib.parse.urlparse(url)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise UsageError(f"{url!r}: a server member is http://HOST:PORT")
        return url.rstrip("/"), f"{u.hostname}-{u.port or 80}"

    def _post(self, route: str, body: dict | None = None) -> dict:
        return self.call(self.url, route, body, timeout=self.timeout)

    def _weight_version(self) -> Any:
        return self.call(self.url, "/weight_info", method="GET", timeout=min(VERSION_TIMEOUT, self.timeout)
                         ).get("weight_version")

    def _init(self, init_info: dict) -> None:
        self._post("/init_weight_transfer_engine", {"init_info": init_info})

    def admit(self, binding: Binding) -> None:
        super().admit(binding)
        credentials.for_another_process(binding.root, self.url)  # refused: a credential, a ROOT of this process

    def _init_info(self, step: int | None) -> dict:
        sent = credentials.for_another_process(self.binding.root, self.url)  # a local ROOT as an absolute path
        return {**super()._init_info(step), "root": sent.url, "storage_options": dict(sent.storage_options)}

    def _prepared(self, init_info: dict) -> None:
        reports = await_prepared(self.binding.root, {"url": self.url, "receiver": init_info["receiver_id"]},
                                 init_info["prepare_id"], self.timeout, clock=self.clock)
        if reports:
            self._reported = init_info["prepare_id"]
            self._pulled = _pulled(reports)
        held = [r["held"] for r in reports or () if "held" in r]  # (a DCR before reports said none)
        if held and (len(set(held)) > 1 or self._expected is _UNSEEN or held[0] != _step(self._expected)):
            self._unsure = True  # its version is not what its engine holds, as DCR knows it (a restart, a stray finish)

    def version(self) -> int | None:
        """As ``_WeightTransfer.version``; and once this switch prepared the member, only while the
        member's last prepare report is still this switch's: another coordinator that prepared it
        since (its session is where a finish of someone else's lands, on a member restarted
        meanwhile too) takes away what this switch can vouch for."""
        said = super().version()
        if said is not None and self._reported is not None:
            rid = self.binding.receiver_id
            cat = Catalog(open_root(self.binding.root))
            last = cat.prepared(rid) or cat.prepared(f"{rid}-rank0") or {}
            if last.get("prepare_id") != self._reported:
                self._unsure = True
                return None
        return said

    def _start(self) -> None:
        self._post("/start_weight_update")

    def _update(self, update_info: dict) -> None:
        self._post("/update_weights", {"update_info": update_info})

    def _finish(self, version: str | None) -> None:
        self._post("/finish_weight_update", {} if version is None else {"weight_version": version})

    def pause(self) -> None:
        self._post("/pause")

    def resume(self) -> None:
        self._post("/resume")


def _pulled(reports: list[dict] | None) -> int | None:
    """The bytes a member's prepare pulled: the sum of its ranks' reports (None: one did not say)."""
    if not reports or any(not isinstance(r.get("bytes_pulled"), int) for r in reports):
        return None
    return sum(r["bytes_pulled"] for r in reports)


def prepare_reports(cat: Catalog, rid: str, prepare_id: str) -> list[dict]:
    """The reports of prepare ``prepare_id`` by receiver ``rid`` (one, or one per TP rank as
    ``<rid>-rankK``): all of them, or only the failed ones while some rank has not reported."""
    docs = [d for d in (cat.prepared(rid),) if d and d.get("prepare_id") == prepare_id]
    if not docs:
        first = cat.prepared(f"{rid}-rank0")
        if first and first.get("prepare_id") == prepare_id:
            ranks = first.get("ranks") if isinstance(first.get("ranks"), int) else 1
            docs = [first] + [cat.prepared(f"{rid}-rank{k}") for k in range(1, ranks)]
            docs = [d for d in docs if d and d.get("prepare_id") == prepare_id]
            if len(docs) < ranks:
                docs = [d for d in docs if not d.get("ok")]  # a failure is enough to stop waiting
    return docs


def await_prepared(root: RootRef, m: dict, prepare_id: str, timeout: float, poll: float = 0.02,
                   clock: Clock = SYSTEM) -> list[dict] | None:
    """Wait until every worker of member ``m`` (``url``, ``receiver``) reported the prepare
    ``prepare_id`` done (``prepared/<receiver>.json``, one per TP rank as ``<receiver>-rankK``), and
    return their reports; raise ``MemberError`` with what one reported failing. None when no report
    came within ``timeout`` (a member whose DCR does not report: the start call then waits for the
    prepare, in its engine loop)."""
    cat = Catalog(open_root(root))
    deadline = clock.monotonic() + timeout
    while True:
        docs = prepare_reports(cat, m["receiver"], prepare_id)
        failed = [d for d in docs if not d.get("ok")]
        if failed:
            raise MemberError(f"{m['url']}: preparing step {failed[0].get('step')} failed: {failed[0].get('error')}", 500)
        if docs:
            return docs
        if clock.monotonic() > deadline:
            log.warning("%s: no prepare report within %.0f s; its start call waits for the prepare", m["url"], timeout)
            return None
        clock.sleep(poll)
        poll = min(poll * 1.5, 0.5)


# -- an LLM in this process ---------------------------------------------------------------------------

_engines: dict[str, Any] = {}
_engines_lock = threading.Lock()


def register_fleet_engine(name: str, llm) -> str:
    """Make the in-process vLLM ``llm`` (started with ``weight_transfer_config={"backend": "dcr"}``)
    a fleet member named ``local:NAME``; returns that URL."""
    layout.check_receiver(name)
    url = f"local:{name}"
    with _engines_lock:
        _engines[url] = llm
    return url


class LocalEngine(_WeightTransfer):
    """A vLLM ``LLM`` of this process registered as ``local:NAME`` (see the module docstring): the
    calls are its own methods; one that raises answered as a server's 500 would."""

    @classmethod
    def from_url(cls, url: str, **how) -> LocalEngine:
        return cls(url)

    @classmethod
    def canonical(cls, url: str) -> tuple[str, str]:
        name = url[len("local:"):]
        if not name:
            raise UsageError(f"{url!r}: an in-process engine member is local:NAME")
        return url, name

    def _llm(self, call: str, *args: Any) -> Any:
        with _engines_lock:
            llm = _engines.get(self.url)
        if llm is None:
            raise MemberError(f"{self.url}: no in-process engine registered under that name (flows.register_fleet_engine)")
        try:
            return getattr(llm, call)(*args)
        except Exception as e:  # noqa: BLE001 - the member answered with an error, as a server's 500 would
            raise MemberError(f"{self.url}: {call}: {type(e).__name__}: {e}", 500) from None

    def _weight_version(self) -> Any:
        return self._llm("get_weight_version")

    def _init(self, init_info: dict) -> None:
        self._llm("init_weight_transfer_engine", {"init_info": init_info})

    def _start(self) -> None:
        self._llm("start_weight_update")

    def _update(self, update_info: dict) -> None:
        self._llm("update_weights", {"update_info": update_info})

    def _finish(self, version: str | None) -> None:
        self._llm("finish_weight_update", version)

    def resume(self) -> None:
        self._llm("reset_prefix_cache")  # KV blocks computed with the old weights (a server's /pause clears them)
