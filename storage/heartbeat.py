"""The publisher's heartbeat: a signed, dated statement that the run is alive, and how far it got.

``heartbeat.json`` at the ROOT holds ``{"format", "run", "latest_step", "at" (seconds since the
epoch, the publisher's clock), "at_utc"}``, signed with the publisher's key as commit markers are.
A publisher writes it after every commit; ``dcr heartbeat ROOT [--every S]`` renews it while a run
is alive between commits. Mirrors copy it (byte for byte: a mirror's heartbeat is its upstream's),
so a mirror that stopped copying serves an old heartbeat.

Why: a signature proves who wrote a step, not when. A mirror frozen at an old, validly signed step
(stuck, or replaying an old copy) looks healthy to its receivers. ``dcr receive --max-staleness S``
refuses a ROOT whose newest heartbeat is older than S seconds, naming its age (and with a key, a
heartbeat that is unsigned or does not verify). Clocks: the age is the receiver's clock minus the
publisher's; choose S well above their skew.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from dcr_core.errors import UntrustedError
from storage import layout, signing
from storage.catalog import Catalog
from storage.document_fields import document, fail, parse_int, parse_run_id
from storage.root import Root

FORMAT = "dcr-heartbeat"
KEY = "heartbeat.json"
MAX_HEARTBEAT_BYTES = 4096


class StaleRootError(UntrustedError):
    """The ROOT's newest heartbeat is older than the receiver accepts (or there is none)."""


@dataclass(frozen=True)
class Heartbeat:
    run: str | None
    latest_step: int | None
    at: float
    signature: str | None = None
    signature_algorithm: str = signing.HMAC_SHA256

    def body(self) -> dict:
        return {"format": FORMAT, "run": self.run, "latest_step": self.latest_step, "at": self.at,
                "at_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.at))}

    def to_json(self) -> bytes:
        return signing.signed_json(self.body(), self.signature, self.signature_algorithm)

    @classmethod
    def from_json(cls, data: bytes, where: str) -> Heartbeat:
        d = document(data, where, FORMAT, "DCR heartbeat")
        at = d.get("at")
        if isinstance(at, bool) or not isinstance(at, int | float) or not math.isfinite(at):
            raise fail(where, "'at' must be a time (seconds since the epoch)")
        step = d.get("latest_step")
        signature, algorithm = signing.signature_field(d, where)
        return cls(None if d.get("run") is None else parse_run_id(d.get("run"), where),
                   None if step is None else parse_int(step, where, 0, layout.MAX_STEP), float(at),
                   signature, algorithm)


def beat(root: Root, run: str | None, latest_step: int | None, key: signing.Key | None = None,
         now: float | None = None) -> Heartbeat:
    """Write the ROOT's heartbeat now (signed with ``key``, the publisher's, when given)."""
    hb = Heartbeat(run, latest_step, time.time() if now is None else now)
    if key is not None:
        hb = Heartbeat(hb.run, hb.latest_step, hb.at, key.sign(hb.body()), key.algorithm)
    root.write(KEY, hb.to_json())
    return hb


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
    run it names: else it was copied without the steps (a mirror replaying an old copy beside a
    fresh heartbeat) or from another ROOT, and ``StaleRootError`` says so."""
    cat = Catalog(root)
    where = f"{root.url}/{KEY}"
    run_here = cat.root_run()
    if hb.run is not None and run_here is not None and hb.run != run_here.run_id:
        raise StaleRootError(f"{where}: a heartbeat of run {hb.run}, but this ROOT holds run {run_here.run_id}")
    if hb.latest_step is not None and cat.marker(hb.latest_step) is None and cat.retraction(hb.latest_step) is None:
        raise StaleRootError(f"{where}: names step {hb.latest_step}, which this ROOT does not hold (a heartbeat "
                             "copied without its steps)")
