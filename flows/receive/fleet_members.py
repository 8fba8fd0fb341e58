"""How ``dcr fleet`` reaches its members: vLLM's weight-transfer calls, over HTTP or in this process.

Every member answers the same calls, named by the routes of a vLLM server in dev mode
(``vllm.entrypoints.rl.online.api_router``): ``/weight_info``, ``/init_weight_transfer_engine``,
``/start_weight_update``, ``/update_weights``, ``/finish_weight_update``, ``/pause`` and
``/resume``. A member is named by a URL:

- ``http://HOST:PORT``: an OpenAI-compatible vLLM server with the ``dcr`` backend (``http_call``);
- ``state:PATH``: a DCR state file (what ``dcr receive --state PATH`` keeps), refitted by the
  coordinator's process (``StateFileMember``): init with ``prepare`` pulls and verifies the step
  into a new file beside it (the file untouched, its lock held), update installs it (one atomic
  rename), finish records the receiver's commit; a start with no update drops what was staged. Its
  weight version is the step its header says. Nothing to pause: a reader of the file sees one
  whole step or the next (the rename is atomic), never a mix;
- ``local:NAME``: a vLLM ``LLM`` in this process, started with ``weight_transfer_config={"backend":
  "dcr"}`` and registered by ``register_fleet_engine(NAME, llm)``: the calls go to the LLM's own
  weight-transfer methods (``LocalEngineMember``); resume resets its prefix cache. Python only
  (``flows.run_fleet``): a command line has no ``LLM`` to register.

A failed call raises ``MemberError`` naming the member and the call; ``status`` is what the member
answered (None: no answer), as for HTTP: an in-process member that raised answered 500.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dcr_core import events
from dcr_core.errors import UsageError
from flows.options import ReceiveOptions
from flows.receive import state_file
from flows.receive.pipeline import Leases
from storage import layout, reader
from storage.local import journal, state
from storage.reader import RefitPlan
from storage.root import RootRef

log = logging.getLogger("dcr.fleet")
HTTP_TIMEOUT = 600.0
SCHEMES = ("http://", "https://", "state:", "local:")


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


def member_call(url: str, route: str, body: dict | None = None, method: str = "POST",
                timeout: float = HTTP_TIMEOUT) -> dict:
    """One weight-transfer call to the member ``url`` (any kind; see the module docstring)."""
    if url.startswith(("http://", "https://")):
        return http_call(url, route, body, method, timeout)
    member = _member(url)
    try:
        return member.handle(route, body or {}) or {}
    except MemberError:
        raise
    except Exception as e:  # noqa: BLE001 - the member answered with an error, as a server's 500 would
        raise MemberError(f"{url}{route}: {type(e).__name__}: {e}", 500) from None


# -- in-process members ---------------------------------------------------------------------------

_members: dict[str, Any] = {}
_members_lock = threading.Lock()


def register_fleet_engine(name: str, llm) -> str:
    """Make the in-process vLLM ``llm`` (started with ``weight_transfer_config={"backend": "dcr"}``)
    a fleet member named ``local:NAME``; returns that URL."""
    layout.check_receiver(name)
    url = f"local:{name}"
    with _members_lock:
        _members[url] = LocalEngineMember(llm)
    return url


def _member(url: str):
    with _members_lock:
        if url in _members:
            return _members[url]
        if url.startswith("local:"):
            raise MemberError(f"{url}: no in-process engine registered under that name (flows.register_fleet_engine)")
        if not url.startswith("state:") or len(url) == len("state:"):
            raise MemberError(f"{url}: not a member URL (expected one of {', '.join(SCHEMES)})")
        member = _members[url] = StateFileMember(url[len("state:"):])
        return member


class LocalEngineMember:
    """A vLLM ``LLM`` in this process, through its own weight-transfer methods."""

    def __init__(self, llm):
        self.llm = llm

    def handle(self, route: str, body: dict) -> dict | None:
        llm = self.llm
        if route == "/weight_info":
            return {"weight_version": llm.get_weight_version()}
        if route == "/init_weight_transfer_engine":
            return llm.init_weight_transfer_engine(body)
        if route == "/start_weight_update":
            return llm.start_weight_update()
        if route == "/update_weights":
            return llm.update_weights(body)
        if route == "/finish_weight_update":
            return llm.finish_weight_update(body.get("weight_version"))
        if route == "/pause":  # the caller drives the LLM: nothing generates while it switches it
            return None
        if route == "/resume":
            llm.reset_prefix_cache()  # KV blocks computed with the old weights (a server's /pause clears them)
            return None
        raise MemberError(f"local engine{route}: not a weight-transfer call", 404)


@dataclass
class _Staging:
    ref: RootRef
    receiver_id: str
    plan: RefitPlan
    staged: state_file.Staged | None
    leases: Leases
    lock: contextlib.ExitStack = field(repr=False)


class StateFileMember:
    """A DCR state file as a fleet member (see the module docstring)."""

    def __init__(self, path: str):
        self.path = state_file.check_path(os.path.abspath(path))
        self._bound: dict | None = None
        self._staging: _Staging | None = None
        self._updated = False
        self._lock = threading.Lock()

    def handle(self, route: str, body: dict) -> dict | None:
        calls: dict[str, Callable[[dict], dict | None]] = {
            "/weight_info": self._weight_info, "/init_weight_transfer_engine": self._init,
            "/start_weight_update": self._start, "/update_weights": self._update,
            "/finish_weight_update": self._finish, "/pause": lambda body: None, "/resume": lambda body: None}
        if route not in calls:
            raise MemberError(f"state:{self.path}{route}: not a weight-transfer call", 404)
        with self._lock:
            return calls[route](body)

    def _weight_info(self, body: dict) -> dict:
        step = state.peek_step(self.path) if os.path.exists(self.path) else None
        return {"weight_version": None if step is None else str(step)}

    def _init(self, body: dict) -> None:
        info = dict(body.get("init_info") or {})
        if not isinstance(info.get("root"), str) or not info["root"]:
            raise UsageError(f"init_info: root must be a ROOT URL, got {info.get('root')!r}")
        layout.check_receiver(info.get("receiver_id", ""))
        self._drop()
        self._bound = info
        if info.get("prepare"):
            self._staging = self._stage(info.get("step"))

    def _start(self, body: dict) -> None:
        if self._bound is None:
            raise UsageError(f"state:{self.path}: no ROOT bound: init_weight_transfer_engine first")
        self._updated = False

    def _update(self, body: dict) -> None:
        step = (body.get("update_info") or {}).get("step")
        if step is not None:
            layout.check_step(step)
        s = self._staging
        if s is None or (step is not None and s.plan.target_step != step):
            self._drop()
            s = self._staging = self._stage(step)
        events.reached("fleet.member-update", member=self.path, step=s.plan.target_step)
        if s.staged is not None:
            state_file.install_state(s.staged)
        self._updated = True
        self._staging = None
        target = reader.manifests(s.plan)[s.plan.target_step]
        record = {"from_step": s.plan.current_step, "moves": s.plan.describe(),
                  "bytes_pulled": s.staged.bytes_pulled if s.staged else 0, "policy_digest": target.policy_digest,
                  "mode": "fleet"}
        try:
            state_file.record_receiver_commit(s.ref, s.receiver_id, s.plan.target_step, record)
        except Exception as e:  # noqa: BLE001 - the file holds the step; its position is recorded by the next refit
            log.warning("receiver %s: recording its commit of step %s failed (%s: %s)", s.receiver_id,
                        s.plan.target_step, type(e).__name__, e)
        finally:
            self._release(s, unlink=False)

    def _finish(self, body: dict) -> None:
        if not self._updated:
            self._drop()  # started, never updated: what was staged is dropped
        self._updated = False

    def _stage(self, step: int | None) -> _Staging:
        """Pull and verify ``step`` into a new file beside the state file (which is not touched)."""
        b = self._bound
        if b is None:
            raise UsageError(f"state:{self.path}: no ROOT bound: init_weight_transfer_engine first")
        ref = RootRef(b["root"], dict(b.get("storage_options") or {}))
        rid = b.get("receiver_id", "")
        opts = ReceiveOptions(**{**(b.get("options") or {}), "in_place": False})  # the old file is the undo
        lock = contextlib.ExitStack()
        lock.enter_context(state.exclusive(self.path))
        leases = Leases(ref, rid, opts.lease_seconds)  # released after the update (or a drop)
        try:
            journal.settle(self.path)

            def stage(p: RefitPlan):
                if not p.moves:
                    return None
                leases.take(p)
                return state_file.stage_refit(p, self.path, opts)

            plan, staged = leases.replanned(lambda: state_file.plan_receive(ref, self.path, step), stage, self.path)
            if staged is None:  # already there: the file must hold the step it claims
                state_file.verify_held_state(plan, self.path)
            return _Staging(ref, rid, plan, staged, leases, lock)
        except BaseException:
            leases.release()
            lock.close()
            raise

    def _drop(self) -> None:
        s, self._staging = self._staging, None
        if s is not None:
            self._release(s, unlink=True)

    @staticmethod
    def _release(s: _Staging, unlink: bool) -> None:
        try:
            if unlink and s.staged is not None:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(s.staged.path)
            s.leases.release()
        finally:
            s.lock.close()
