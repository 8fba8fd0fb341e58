"""What ROOT holds: committed steps, their commit markers and manifests, receiver records.

A step is committed exactly when ``steps/<step>/commit.json`` exists. Everything read here is
checked: markers against their location (and their signature when a key is set), manifests
against the marker's digest and the marker's own fields, before any caller sees them.

Caching: a ``Catalog`` remembers the markers it found (a marker never changes while it exists;
``dcr gc`` deletes it, and a reader that raced gc then fails on a missing object, as it would
without a cache), never that a marker is absent: a step may be committed at any moment, so a
poller asks again. Manifests are cached for the whole process by (ROOT, step, manifest digest):
content-addressed, so a cached manifest is exactly the bytes the marker binds.
"""

from __future__ import annotations

import calendar
import json
import logging
import os
import re
import threading
import time
from collections import OrderedDict

import blake3

from dcr_core.chain import DELTA, StepInfo
from dcr_core.errors import DCRError, IntegrityError, RootNotFoundError, StepNotFoundError, UntrustedError, UsageError
from storage import layout, receiver_record, run_identity, signing
from storage.backends import registry
from storage.manifest import MAX_MANIFEST_BYTES, Manifest
from storage.marker import MAX_MARKER_BYTES, CommitMarker
from storage.receiver_record import MAX_RECORD_BYTES
from storage.retraction import MAX_RETRACTION_BYTES, Retraction
from storage.root import Root

log = logging.getLogger("dcr.catalog")

MANIFEST_CACHE_SIZE = 64


# A receiver record keeps its receiver's earlier visits to the same step (a receiver moved back to a
# step it held, by a retraction or a lower --step): the most recent ones, so a record stays small.
MAX_EARLIER_VISITS = 32

_STAMP = re.compile(r"(\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2})(\.\d{1,9})?Z")


def utc_now(at: float | None = None) -> str:
    """A UTC time stamp to the millisecond (``2025-01-31T12:00:00.123Z``; ``at``: epoch seconds, default
    now): commits and refits within one second keep their order (``dcr report``'s lag over time)."""
    ms = int((time.time() if at is None else at) * 1000)
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(ms // 1000)) + f".{ms % 1000:03d}Z"


def utc_epoch(stamp: object) -> float | None:
    """Epoch seconds of a ``utc_now`` stamp, or of the whole-second stamps (``...:05Z``) earlier
    versions wrote; None for anything else (stamps are read from the bucket: shown, not trusted)."""
    m = _STAMP.fullmatch(stamp) if isinstance(stamp, str) else None
    if m is None:
        return None
    try:
        whole = calendar.timegm(time.strptime(m.group(1), "%Y-%m-%dT%H:%M:%S"))
    except ValueError:
        return None
    return float(whole) + (float(m.group(2)) if m.group(2) else 0.0)


def manifest_digest(data: bytes) -> str:
    return blake3.blake3(data).hexdigest()


_MANIFESTS: OrderedDict[tuple[str, int, str], Manifest] = OrderedDict()
_MANIFESTS_LOCK = threading.Lock()


def _cached_manifest(key: tuple[str, int, str]) -> Manifest | None:
    with _MANIFESTS_LOCK:
        m = _MANIFESTS.get(key)
        if m is not None:
            _MANIFESTS.move_to_end(key)
        return m


def _cache_manifest(key: tuple[str, int, str], m: Manifest) -> None:
    with _MANIFESTS_LOCK:
        _MANIFESTS[key] = m
        while len(_MANIFESTS) > MANIFEST_CACHE_SIZE:
            _MANIFESTS.popitem(last=False)


def _check_agrees(m: Manifest, marker: CommitMarker, where: str) -> None:
    """The manifest says what its marker says (a marker edited beside an intact manifest is refused)."""
    if (m.step, m.attempt, m.kind, m.base_step, m.policy_digest) != (
        marker.step, marker.attempt, marker.kind, marker.base_step, marker.policy_digest
    ):
        raise IntegrityError(f"{where}: manifest disagrees with its commit marker")


class Catalog:
    """Read access to the steps of one ROOT (see the module docstring for what is cached)."""

    def __init__(self, root: Root):
        self.root = root
        self.key = signing.verify_key()  # markers must be signed with it when set
        if self.key is None and signing.require_signed():
            signing.check_verifiable(root.url, signing.ENV_REQUIRE_SIGNED)
        self._markers: dict[int, CommitMarker] = {}
        self._retractions: dict[int, Retraction | None] = {}
        self._run: run_identity.Run | None = None
        self._run_read = False  # whether _run holds what run.json said

    def listed_steps(self) -> list[int]:
        """Every step with a prefix under ``steps/`` (committed or not), ascending. An object named
        like a step (``steps/000000000007``, not under it) is no step: it is never probed for a
        marker, so junk objects there cost nothing beyond the one listing."""
        steps = (layout.parse_step_dir(n) for n in self.root.listdir(layout.STEPS, prefixes=True))
        return sorted(s for s in steps if s is not None)

    def committed_steps(self) -> list[int]:
        """The live steps: committed and not retracted (what refits target and publishes build on)."""
        return [s for s in self.listed_steps() if self.is_live(s)]

    def ever_committed_steps(self) -> list[int]:
        """Every step with a commit marker (its data here), retracted ones included."""
        return [s for s in self.listed_steps() if self.marker(s) is not None]

    def used_steps(self) -> list[int]:
        """Every step number ever committed: those with a marker, and retracted steps that gc deleted
        (their retraction record stays as a tombstone). A number is never used twice."""
        return [s for s in self.listed_steps() if self.marker(s) is not None or self.retraction(s) is not None]

    def latest_committed(self) -> int | None:
        """The newest live step (retracted steps are skipped), or None."""
        for s in reversed(self.listed_steps()):
            if self.is_live(s):
                return s
        return None

    def is_live(self, step: int) -> bool:
        return self.marker(step) is not None and self.retraction(step) is None

    def retraction(self, step: int) -> Retraction | None:
        """The verified retraction record of ``step``, or None (``storage.retraction``). Of a step gc
        deleted, the record stays alone (a tombstone): checked by its signature only."""
        if step not in self._retractions:
            self.read_retraction(step)
        return self._retractions[step]

    def read_retraction(self, step: int) -> tuple[Retraction, bytes] | None:
        """``step``'s retraction record read now and checked as ``retraction`` checks it, with the
        bytes that were checked (what a mirror copies: never a second read, which may differ)."""
        key = layout.retraction_key(step)
        try:
            data = self.root.read(key, limit=MAX_RETRACTION_BYTES)
        except FileNotFoundError:
            self._retractions[step] = None  # a retraction only ever appears: re-read by a new Catalog
            return None
        marker = self.marker(step)  # read after the record: a step with none costs one read
        where = f"{self.root.url}/{key}"
        r = Retraction.from_json(data, where, step)
        if marker is None:
            pass  # a tombstone: its step's marker and data are gone (dcr gc)
        elif (r.attempt, r.manifest_digest) != (marker.attempt, marker.manifest_digest):
            raise UntrustedError(f"{where}: retracts attempt {r.attempt}, but step {step} committed {marker.attempt}")
        elif r.run != marker.run:
            raise UntrustedError(f"{where}: names run {r.run}, the step's marker run {marker.run}")
        if self.key is None:
            if r.signature is not None:
                _unchecked(self.root.url, f"its records are signed ({r.signature_algorithm})")
        elif r.signature is None:
            raise UntrustedError(f"{where}: retraction is not signed, and {self.key.source} says records must be signed")
        elif r.signature_algorithm != self.key.algorithm or not self.key.verify(r.body(), r.signature):
            raise UntrustedError(f"{where}: retraction signature does not match (tampered, or another key)")
        self._retractions[step] = r
        return r, data

    def marker(self, step: int) -> CommitMarker | None:
        m = self._markers.get(step)
        if m is None:
            found = self.read_marker(step)
            m = None if found is None else found[0]
        return m

    def require_marker(self, step: int) -> CommitMarker:
        m = self.marker(step)
        if m is None:
            raise not_committed(self.root, f"step {step} is not committed")
        return m

    def read_marker(self, step: int) -> tuple[CommitMarker, bytes] | None:
        """``step``'s commit marker read now and checked (signature, run), with the bytes that were
        checked (what a mirror copies: never a second read, which may differ); None if absent."""
        key = layout.commit_key(step)
        try:
            data = self.root.read(key, limit=MAX_MARKER_BYTES)
        except FileNotFoundError:
            return None
        where = f"{self.root.url}/{key}"
        marker = CommitMarker.from_json(data, where, step)
        if self.key is None:
            if marker.signature is not None:
                _unchecked(self.root.url, f"its commit markers are signed ({marker.signature_algorithm})")
        else:
            if marker.signature is None:
                raise UntrustedError(f"{where}: commit marker is not signed, and {self.key.source} says markers must "
                                     "be signed")
            if marker.signature_algorithm != self.key.algorithm:
                raise UntrustedError(f"{where}: commit marker is signed with {marker.signature_algorithm}, and this "
                                     f"reader verifies {self.key.algorithm} signatures ({self.key.source})")
            if not self.key.verify(marker.body(), marker.signature):
                raise UntrustedError(f"{where}: commit marker signature does not match (tampered, or another key)")
        self._check_run(marker, step, where)
        self._markers[step] = marker
        return marker, data

    def _check_run(self, marker: CommitMarker, step: int, where: str) -> None:
        the_run = self.root_run()
        if self.key is None and the_run is not None and the_run.signed is not None:
            _unchecked(self.root.url, f"its run.json says its steps are signed ({the_run.signed})")
        if the_run.accepts(marker.run, step) if the_run is not None else marker.run is None:
            return
        the_run = self.root_run(fresh=True)  # the cached answer may be seconds old: read again
        if the_run is not None:
            the_run.check(marker.run, step, where)
        elif marker.run is not None:
            raise UntrustedError(f"{where}: names run {marker.run}, but {self.root.url} has no run.json (deleted?)")

    def root_run(self, fresh: bool = False) -> run_identity.Run | None:
        """The ROOT's run (``storage.run_identity.read``: what this process read seconds ago may answer;
        ``fresh`` reads it again)."""
        if not self._run_read or fresh:
            self._run = run_identity.read(self.root, cached=not fresh)
            self._run_read = True
        return self._run

    def manifest(self, step: int) -> Manifest:
        """The verified manifest of committed ``step``."""
        marker = self.require_marker(step)
        cache_key = (self.root.url, step, marker.manifest_digest)
        m = _cached_manifest(cache_key)
        if m is None:
            m = self._read_verified(marker.manifest_key, marker.manifest_digest)
            _cache_manifest(cache_key, m)
        _check_agrees(m, marker, f"{self.root.url}/{marker.manifest_key}")
        return m

    def manifest_at(self, step: int, attempt: str, digest: str) -> Manifest:
        """The manifest of ``step``'s ``attempt`` whose digest is ``digest`` (a ``StepRef`` a plan
        pinned), from the process cache or read and checked against that digest."""
        m = _cached_manifest((self.root.url, step, digest))
        if m is None:
            m = self._read_verified(layout.manifest_key(step, attempt), digest)
            if (m.step, m.attempt) != (step, attempt):
                raise IntegrityError(f"{self.root.url}/{layout.manifest_key(step, attempt)}: manifest of another step")
            _cache_manifest((self.root.url, step, digest), m)
        return m

    def _read_verified(self, key: str, digest: str) -> Manifest:
        where = f"{self.root.url}/{key}"
        try:
            data = self.root.read(key, limit=MAX_MANIFEST_BYTES)
        except FileNotFoundError:
            raise IntegrityError(f"{where}: manifest named by the commit marker is missing") from None
        if manifest_digest(data) != digest:
            raise IntegrityError(f"{where}: manifest digest does not match the commit marker")
        return Manifest.from_json(data, where)

    def step_info(self, step: int) -> StepInfo:
        marker = self.require_marker(step)
        s = marker.summary
        return StepInfo(
            step=step,
            base_step=marker.base_step if marker.kind == DELTA else None,
            invertible=bool(s.get("invertible", False)),
            stored_bytes=int(s.get("bytes_stored", 0)),
            restart_bytes=int(s["snapshot_bytes"]) if marker.kind == DELTA and isinstance(s.get("snapshot_bytes"), int) else None,
        )

    def keyframe_cost(self, step: int) -> int | None:
        """Stored bytes of the keyframe path to ``step`` (keyframe plus deltas), if its marker says."""
        v = self.require_marker(step).summary.get("chain_bytes")
        return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else None

    def chain_infos(self, *steps: int | None) -> dict[int, StepInfo]:
        """StepInfo of every step on the chains of ``steps`` back to their keyframes."""
        out: dict[int, StepInfo] = {}
        for s in steps:
            while s is not None and s not in out:
                if self.marker(s) is None:
                    break
                info = out[s] = self.step_info(s)
                s = info.base_step
        return out

    def receivers(self, step: int) -> list[str]:
        """The receivers that recorded a commit of ``step``."""
        return _receiver_ids(self.root.listdir(layout.receivers_dir(step)))

    def record_receiver(self, step: int, receiver_id: str, record: dict) -> None:
        """The receiver's commit of ``step`` (``steps/N/receivers/<id>.json``: its history, one record per
        step it reached, kept as long as the step) and where it is now (``receivers/<id>.json``). A
        receiver back at a step it held before keeps its earlier visits there: the record's ``earlier``
        (oldest first, at most ``MAX_EARLIER_VISITS``), which ``dcr status --receiver`` lists as refits."""
        record = {"receiver": receiver_id, "step": step, "committed_at": utc_now(), **record}
        data = json.dumps(record, indent=1).encode() + b"\n"
        earlier = self._visits_before(step, receiver_id)
        kept = json.dumps({**record, "earlier": earlier}, indent=1).encode() + b"\n" if earlier else data
        self.root.write(layout.receiver_key(step, receiver_id), kept)
        self.root.write(layout.position_key(receiver_id), data)

    def _visits_before(self, step: int, receiver_id: str) -> list[dict]:
        """The receiver's visits to ``step`` recorded so far (the record there and its ``earlier``)."""
        try:
            prev = self.receiver_record(step, receiver_id)
        except Exception as e:  # noqa: BLE001 - a role that may write records but not read them: no history kept
            log.info("%s: cannot read receiver %s's record of step %d (%s); its earlier visits are not kept",
                     self.root.url, receiver_id, step, e)
            return []
        if prev is None:
            return []
        visits = [*earlier_visits(prev), {k: v for k, v in prev.items() if k != "earlier"}]
        return visits[-MAX_EARLIER_VISITS:]

    def _record(self, key: str) -> dict | None:
        try:
            doc = json.loads(self.root.read(key, limit=MAX_RECORD_BYTES))
        except FileNotFoundError:
            return None
        except (ValueError, IntegrityError) as e:  # a record is what receivers say of themselves: shown, not trusted
            log.warning("%s/%s: unreadable record (%s)", self.root.url, key, e)
            return None
        if not isinstance(doc, dict) or not isinstance(doc.get("step"), int):
            log.warning("%s/%s: not a record of a step", self.root.url, key)
            return None
        return doc

    def checked_receiver_record(self, key: str) -> dict | IntegrityError | None:
        """The receiver record at ``key``, validated (``storage.receiver_record``); None if there is
        none; the error naming it if it is damaged (a record is what receivers say of themselves)."""
        try:
            return receiver_record.parse(self.root.read(key, limit=MAX_RECORD_BYTES), f"{self.root.url}/{key}")
        except FileNotFoundError:
            return None
        except IntegrityError as e:
            return e
        except ValueError as e:  # a key that cannot be read as an object, said as the damage it is
            return IntegrityError(f"{self.root.url}/{key}: {e}")

    def _receiver_record(self, key: str) -> dict | None:
        found = self.checked_receiver_record(key)
        if isinstance(found, IntegrityError):
            log.warning("%s", found)  # shown, not trusted: as if it had recorded nothing
            return None
        return found

    def receiver_record(self, step: int, receiver_id: str) -> dict | None:
        return self._receiver_record(layout.receiver_key(step, receiver_id))

    def record_prepared(self, receiver_id: str, record: dict) -> None:
        """A receiver's background prepare is over (``prepared/<id>.json``: ``step``, ``prepare_id``,
        ``ok`` or ``error``): how a fleet learns, without asking the engine, that phase 1 is done.
        Advisory: the member's own start call is still what decides."""
        data = json.dumps({"receiver": receiver_id, "at": utc_now(), **record}, indent=1).encode() + b"\n"
        self.root.write(layout.prepared_key(receiver_id), data)

    def prepared(self, receiver_id: str) -> dict | None:
        """The receiver's last prepare record (None: none, or unreadable)."""
        return self._record(layout.prepared_key(receiver_id))

    def position(self, receiver_id: str) -> dict | None:
        """Where ``receiver_id`` is now: its latest record (None if it never recorded one here)."""
        return self._receiver_record(layout.position_key(receiver_id))

    def position_records(self, recorded: dict[int, list[str]] | None = None) -> dict[str, dict | IntegrityError]:
        """Every receiver's latest record, or the error naming it where it is damaged. Receivers that
        recorded commits before positions existed are placed at the highest step they recorded
        (``recorded``: step -> receivers, if listed already)."""
        out: dict[str, dict | IntegrityError] = {}
        for rid in _receiver_ids(self.root.listdir(layout.POSITIONS_DIR)):
            found = self.checked_receiver_record(layout.position_key(rid))
            if found is not None:
                out[rid] = found
        if recorded is None:
            recorded = self.recorded()
        for step in sorted(recorded, reverse=True):
            for rid in recorded[step]:
                if rid not in out:
                    out[rid] = self.checked_receiver_record(layout.receiver_key(step, rid)) or {"receiver": rid, "step": step}
        return out

    def positions(self, recorded: dict[int, list[str]] | None = None) -> dict[str, dict]:
        """Every receiver's latest record (``position_records``); a damaged one is said, and its
        receiver placed at the highest step that lists it, if any (what ``dcr gc`` keeps for it)."""
        recorded = self.recorded() if recorded is None else recorded
        out = {}
        for rid, found in self.position_records(recorded).items():
            if isinstance(found, IntegrityError):
                log.warning("%s", found)
                steps = [step for step, rids in recorded.items() if rid in rids]
                if not steps:
                    continue
                found = {"receiver": rid, "step": max(steps)}
            out[rid] = found
        return out

    def recorded(self) -> dict[int, list[str]]:
        """step -> the receivers that recorded a commit of it, for every step listed."""
        return {step: self.receivers(step) for step in self.listed_steps()}


def _receiver_ids(names: list[str]) -> list[str]:
    """The receiver ids of a listing of records: a name no receiver id could have is nothing DCR
    wrote (and, printed, could forge a row): left out."""
    ids = []
    for name in names:
        if name.endswith(".json"):
            try:
                ids.append(layout.check_receiver(name[: -len(".json")]))
            except UsageError:
                continue
    return ids


def earlier_visits(record: dict) -> list[dict]:
    """The earlier visits a receiver record keeps (``record_receiver``; validated with it), oldest first."""
    return list(record.get("earlier") or [])


_WARNED_UNCHECKED: set[str] = set()


def _unchecked(url: str, why: str) -> None:
    """Say once per ROOT and process that a signed ROOT is read by a reader with no key."""
    if url in _WARNED_UNCHECKED:
        return
    _WARNED_UNCHECKED.add(url)
    log.warning("%s: %s, but this reader has no key: signatures are not checked (set %s to the publisher's public "
                "key, or %s / %s for HMAC; %s=1 refuses to read without one)", url, why, signing.ENV_VERIFY_KEY_FILE,
                signing.ENV_KEY, signing.ENV_KEY_FILE, signing.ENV_REQUIRE_SIGNED)


# a registered scheme followed by "//" without its colon: a local path only by accident
_SCHEME_WITHOUT_COLON = re.compile(rf"^({'|'.join(map(re.escape, registry.schemes()))})//")


def no_such_directory(root: Root) -> str | None:
    """Why a local ROOT holds nothing, when the cause is that its directory does not exist (what a
    message should then say, with the typo it looks like if it looks like one); else None."""
    if not root.backend.local or os.path.isdir(root.path):
        return None
    hint = ""
    if _SCHEME_WITHOUT_COLON.match(root.url):
        scheme, _, rest = root.url.partition("//")
        hint = f" (did you mean {scheme}://{rest}?)"
    return f"no such directory{hint}; ROOT is where dcr publish wrote its steps"


def missing_root(root: Root) -> RootNotFoundError | None:
    """The error for a local ROOT whose directory does not exist (a typo, most likely), else None."""
    missing = no_such_directory(root)
    return RootNotFoundError(f"{root.url}: {missing}") if missing else None


def unpublished(root: Root) -> RootNotFoundError | None:
    """Why ROOT holds nothing a publisher wrote (``run.json`` or a step): it does not exist, or nothing
    was ever published there; None if it holds something."""
    missing = missing_root(root)
    if missing is not None:
        return missing
    if root.exists(layout.RUN) or Catalog(root).listed_steps():
        return None
    return RootNotFoundError(f"{root.url}: nothing was ever published here (no {layout.RUN}, no {layout.STEPS}/); "
                             "check the ROOT, or publish a step first")


def require_published(root: Root) -> None:
    """What a read command (``ls``, ``show``, ``status``, ``verify``, ``report``) checks first: ROOT
    holds something a publisher wrote, else a one-line ``RootNotFoundError`` naming the path and
    saying what was expected. A misspelt ROOT is never reported as healthy."""
    error = unpublished(root)
    if error is not None:
        raise error


def not_committed(root: Root, what: str) -> DCRError:
    """The error for a step ROOT does not hold committed (``what`` says which): ``RootNotFoundError``
    when ROOT itself is missing or empty (looked at only then), else ``StepNotFoundError``."""
    return unpublished(root) or StepNotFoundError(f"{root.url}: {what}")
