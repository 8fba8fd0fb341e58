"""The publisher's heartbeat: a signed, dated statement that the run is alive, how far it got, and
what it took back.

``heartbeat.json`` at the ROOT holds ``{"format", "run", "latest_step" (the newest live step),
"retracted" (every step of the run retracted so far, ascending), "at" (seconds since the epoch, the
publisher's clock), "at_utc"}``, signed with the publisher's key as commit markers are. A publisher
writes it after every commit, ``dcr retract`` after every retraction, and ``dcr heartbeat ROOT
[--every S]`` renews it while a run is alive between commits. Mirrors copy it (byte for byte: a
mirror's heartbeat is its upstream's), so a mirror that stopped copying serves an old heartbeat.

Why: a signature proves who wrote a step, not when. A mirror frozen at an old, validly signed step
(stuck, or replaying an old copy) looks healthy to its receivers. ``dcr receive --max-staleness S``
refuses a ROOT whose newest heartbeat is older than S seconds, naming its age (and with a key, a
heartbeat that is unsigned or does not verify), and one whose heartbeat does not vouch for what it
shows: the step it names missing, or a step it names retracted shown live (a mirror that lags behind
a retraction, or whose retraction record was deleted). Clocks: the age is the receiver's clock minus
the publisher's; choose S well above their skew.

A heartbeat never goes backwards: a renewal refuses to name a step older than the one the previous
heartbeat of the run named (verified, where signing is on) unless that step was retracted, so a
writer who hides the newest commit marker during a renewal gets no signed heartbeat for the old
step. Cost: a commit's heartbeat carries the previous one's retracted steps forward (and adds those
above the newest live step, read anyway to find it); ``dcr heartbeat`` and ``dcr retract`` read
every step's retraction record, as does a heartbeat with no usable predecessor.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, replace

from dcr_core.errors import DCRError, UntrustedError
from storage import layout, signing
from storage.catalog import Catalog
from storage.document_fields import document, fail, parse_int, parse_run_id
from storage.root import Root

log = logging.getLogger("dcr.storage")

FORMAT = "dcr-heartbeat"
KEY = "heartbeat.json"
MAX_HEARTBEAT_BYTES = 64 << 10  # a few hundred bytes, and 14 more per retracted step


class StaleRootError(UntrustedError):
    """The ROOT's newest heartbeat is older than the receiver accepts (or there is none)."""


class HeartbeatRegressionError(UntrustedError):
    """A renewal would name an older step than the previous heartbeat named, and that step was not
    retracted: the bucket hides a newer step (nothing is signed)."""


@dataclass(frozen=True)
class Heartbeat:
    run: str | None
    latest_step: int | None
    at: float
    retracted: tuple[int, ...] | None = None  # None: written before heartbeats named retracted steps
    signature: str | None = None
    signature_algorithm: str = signing.HMAC_SHA256

    def body(self) -> dict:
        return ({"format": FORMAT, "run": self.run, "latest_step": self.latest_step}
                | ({} if self.retracted is None else {"retracted": list(self.retracted)})
                | {"at": self.at, "at_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.at))})

    def to_json(self) -> bytes:
        return signing.signed_json(self.body(), self.signature, self.signature_algorithm)

    @classmethod
    def from_json(cls, data: bytes, where: str) -> Heartbeat:
        d = document(data, where, FORMAT, "DCR heartbeat")
        at = d.get("at")
        if isinstance(at, bool) or not isinstance(at, int | float) or not math.isfinite(at):
            raise fail(where, "'at' must be a time (seconds since the epoch)")
        step = d.get("latest_step")
        retracted = d.get("retracted")
        if retracted is not None:
            if not isinstance(retracted, list):
                raise fail(where, "'retracted' must be a list of step numbers")
            retracted = tuple(parse_int(s, where, 0, layout.MAX_STEP) for s in retracted)
            if list(retracted) != sorted(set(retracted)):
                raise fail(where, "'retracted' must list step numbers once each, ascending")
        signature, algorithm = signing.signature_field(d, where)
        return cls(None if d.get("run") is None else parse_run_id(d.get("run"), where),
                   None if step is None else parse_int(step, where, 0, layout.MAX_STEP), float(at), retracted,
                   signature, algorithm)


def beat(root: Root, key: signing.Key | None = None, now: float | None = None, scan: bool = False,
         floor: Heartbeat | None = None) -> Heartbeat:
    """Write the ROOT's heartbeat now (signed with ``key``, the publisher's, when given): its run, its
    newest live step and its retracted steps. ``scan``: read every step's retraction record rather
    than carry the previous heartbeat's forward. ``floor``: a heartbeat this process wrote before
    (a renewal loop's last), which the new one may not go behind either. ``HeartbeatRegressionError``
    (nothing written) when it would go backwards (see the module docstring)."""
    cat = Catalog(root)
    the_run = cat.root_run(fresh=True)
    run = None if the_run is None else the_run.run_id
    previous = _previous(root, key, run)
    steps = cat.listed_steps()
    latest = next((s for s in reversed(steps) if cat.is_live(s)), None)
    if scan or previous is None or previous.retracted is None:
        retracted = {s for s in steps if cat.retraction(s) is not None}
    else:  # the previous heartbeat's, and any above the newest live step (a retraction since)
        retracted = set(previous.retracted) | {s for s in steps if (latest is None or s > latest)
                                               and cat.retraction(s) is not None}
    for before in (previous, floor):
        if before is None or before.run != run:
            continue
        retracted |= set(before.retracted or ())
        named = before.latest_step
        if named is not None and (latest is None or latest < named) and cat.retraction(named) is None:
            raise HeartbeatRegressionError(
                f"{root.url}: its newest live step is {latest}, older than step {named} its previous heartbeat "
                f"named, which was not retracted (its commit marker hidden or deleted?); no heartbeat signed")
    hb = Heartbeat(run, latest, time.time() if now is None else now, tuple(sorted(retracted)))
    if key is not None:
        hb = replace(hb, signature=key.sign(hb.body()), signature_algorithm=key.algorithm)
    data = hb.to_json()
    if len(data) > MAX_HEARTBEAT_BYTES:
        raise DCRError(f"{root.url}/{KEY}: a heartbeat naming {len(retracted)} retracted steps would be larger than "
                       f"{MAX_HEARTBEAT_BYTES} bytes; not written")
    root.write(KEY, data)
    return hb


def beat_after(root: Root, key: signing.Key | None, what: str) -> Heartbeat | None:
    """``beat`` after a commit or a retraction, which stands whatever happens here: a failure costs
    only freshness, and is said."""
    try:
        return beat(root, key)
    except (OSError, DCRError) as e:
        log.warning("%s: %s, but the heartbeat was not written (%s)", root.url, what, e)
        return None


def _previous(root: Root, key: signing.Key | None, run: str | None) -> Heartbeat | None:
    """The ROOT's heartbeat of ``run`` as it stands, verified with ``key``'s verifying half; None if
    there is none, it is of another run, or it does not verify (said: a new one replaces it)."""
    try:
        hb = read(root, None if key is None else key.verifier())
    except DCRError as e:
        log.warning("%s", e)
        return None
    return hb if hb is not None and hb.run == run else None


def read(root: Root, key: signing.Key | None = None) -> Heartbeat | None:
    """The ROOT's heartbeat, its signature checked when a reader ``key`` is given; None if none."""
    where = f"{root.url}/{KEY}"
    try:
        data = root.read(KEY, limit=MAX_HEARTBEAT_BYTES)
    except FileNotFoundError:
        return None
    return verified(data, where, key)


def verified(data: bytes, where: str, key: signing.Key | None = None) -> Heartbeat:
    """The heartbeat ``data`` holds, its signature checked when a reader ``key`` is given (a mirror
    checks the very bytes it copies)."""
    hb = Heartbeat.from_json(data, where)
    if key is not None:
        if hb.signature is None:
            raise UntrustedError(f"{where}: heartbeat is not signed, and {key.source} says it must be")
        if hb.signature_algorithm != key.algorithm or not key.verify(hb.body(), hb.signature):
            raise UntrustedError(f"{where}: heartbeat signature does not match (tampered, or another key)")
    return hb


def check_fresh(root: Root, max_staleness: float, key: signing.Key | None = None, now: float | None = None) -> Heartbeat:
    """The ROOT's heartbeat if it is at most ``max_staleness`` seconds old; else ``StaleRootError``."""
    hb = read(root, key)
    if hb is None:
        raise StaleRootError(f"{root.url}: no heartbeat ({KEY}), and --max-staleness {max_staleness:g} s asks for one "
                             "(its publisher predates heartbeats, or this mirror never copied one)")
    age = (time.time() if now is None else now) - hb.at
    if age > max_staleness:
        raise StaleRootError(f"{root.url}: its newest heartbeat is {age:.0f} s old (at "
                             f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime(hb.at))}, latest step {hb.latest_step}), "
                             f"more than --max-staleness {max_staleness:g} s: the publisher stopped, or this ROOT (a "
                             "mirror?) stopped copying")
    vouches_for(root, hb)
    return hb


def vouches_for(root: Root, hb: Heartbeat) -> None:
    """A heartbeat speaks for the ROOT it lies in only if that ROOT holds the step it names, of the
    run it names, and shows retracted every step it names retracted that the ROOT holds: else it was
    copied without the steps (a mirror replaying an old copy beside a fresh heartbeat), from another
    ROOT, or the ROOT hides a retraction (a mirror that lags, or whose record was deleted), and
    ``StaleRootError`` says so."""
    cat = Catalog(root)
    where = f"{root.url}/{KEY}"
    run_here = cat.root_run()
    if hb.run is not None and run_here is not None and hb.run != run_here.run_id:
        raise StaleRootError(f"{where}: a heartbeat of run {hb.run}, but this ROOT holds run {run_here.run_id}")
    if hb.latest_step is not None and cat.marker(hb.latest_step) is None and cat.retraction(hb.latest_step) is None:
        raise StaleRootError(f"{where}: names step {hb.latest_step}, which this ROOT does not hold (a heartbeat "
                             "copied without its steps)")
    for s in hb.retracted or ():
        if cat.marker(s) is not None and cat.retraction(s) is None:
            raise StaleRootError(f"{where}: says step {s} was retracted, but this ROOT shows it live (its retraction "
                                 "record missing: not copied yet, or deleted)")
