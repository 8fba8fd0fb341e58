"""Leases: a receiver says which steps it is reading, so ``dcr gc`` keeps them until it is done.

A lease is ``steps/<N>/leases/<receiver-id>.json`` holding ``{"receiver", "expires_at", "target"}``
(``expires_at`` in seconds since the epoch, by the receiver's clock). A receiver takes one for
every step its plan reads, right after planning, then checks that each step is still committed
(gc may have planned before the lease existed); it releases them when its refit is recorded. gc
keeps every step with a lease that has not expired, and looks again right before deleting a step's
marker. A lease that outlives its receiver (a kill) expires; gc then deletes it with the step, or
as a leftover. Clocks: gc trusts a lease until ``expires_at`` plus a margin, so receivers' clocks
may run a little behind gc's.

What this leaves open, and how receivers close it: a receiver whose lease lands after gc's last
look finds a step missing; it plans again (``flows.receive.pipeline``). A receiver that finished a
step gc deleted meanwhile holds a step that is no longer committed; it restarts from a restart
point, its state untouched until the new one is verified (unless its step is newer than every
committed step: a ROOT rolled back is refused, not followed).

A lease is honoured for at most ``MAX_TTL`` seconds from now (a receiver may ask for no more;
``--lease-seconds`` above it, or not a finite number, is refused). Anyone who can write the bucket
can write a lease, so gc does not trust what it cannot have come from a receiver: a lease whose
``expires_at`` is not a finite number or lies further ahead than ``MAX_TTL`` (beyond the clock
margin), whose name is not a receiver id, or that cannot be read and is older than
``GARBAGE_AFTER`` seconds, pins nothing: it is garbage, which gc removes and names in its report.
An unreadable lease younger than that still counts as live (gc never guesses in favour of deleting).
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import dataclass, field

from dcr_core.errors import DCRError, UsageError
from storage import layout
from storage.root import Root

log = logging.getLogger("dcr.storage")

DEFAULT_TTL = 3600.0
MAX_TTL = 24 * 3600.0  # the longest lease a receiver may take, and gc honours
CLOCK_MARGIN = 60.0  # gc honours a lease this long past its expiry
GARBAGE_AFTER = 600.0  # an unreadable lease older than this is garbage, not a live lease
MAX_LEASE_BYTES = 4096


def check_ttl(ttl: float) -> float:
    """A lease's length in seconds: a finite number in (0, ``MAX_TTL``], else a ``UsageError``."""
    if not isinstance(ttl, int | float) or not math.isfinite(ttl) or not 0 < ttl <= MAX_TTL:
        raise UsageError(f"a lease lasts more than 0 and at most {MAX_TTL:.0f} seconds, got {ttl!r}")
    return float(ttl)


def take(root: Root, receiver_id: str, steps: list[int], target: int, ttl: float = DEFAULT_TTL) -> None:
    """Lease ``steps`` for ``receiver_id`` for ``ttl`` seconds (overwrites its earlier leases)."""
    body = json.dumps({"receiver": receiver_id, "expires_at": time.time() + check_ttl(ttl), "target": target}).encode()
    for s in steps:
        root.write(layout.lease_key(s, receiver_id), body)


def release(root: Root, receiver_id: str, steps: list[int]) -> None:
    """Drop the leases of ``steps`` (best effort: they expire anyway)."""
    for s in steps:
        try:
            root.remove(layout.lease_key(s, receiver_id))
        except FileNotFoundError:
            pass
        except (OSError, DCRError) as e:
            log.info("could not release the lease of step %d (%s); it expires", s, e)


@dataclass
class Leases:
    """What ``scan`` found under one step's ``leases/``."""

    live: list[str] = field(default_factory=list)  # receivers whose leases gc honours
    garbage: list[tuple[str, str]] = field(default_factory=list)  # (key, why): pins nothing; gc removes it


def scan(root: Root, step: int, now: float | None = None) -> Leases:
    """The leases of ``step``: the live ones, and the garbage (see the module docstring)."""
    now = time.time() if now is None else now
    out = Leases()
    for obj in root.objects(layout.leases_dir(step)):
        name = obj.key.rsplit("/", 1)[-1]
        rid = name[: -len(".json")] if name.endswith(".json") else None
        if "/" in obj.key[len(layout.leases_dir(step)) + 1:] or rid is None or not _is_receiver_id(rid):
            out.garbage.append((obj.key, "not a lease a receiver takes (its name is not <receiver id>.json)"))
            continue
        try:
            d = json.loads(root.read(obj.key, limit=MAX_LEASE_BYTES))
            expires = d["expires_at"]
            if isinstance(expires, bool) or not isinstance(expires, int | float):
                raise TypeError("expires_at is not a number")
        except FileNotFoundError:
            continue  # released meanwhile
        except (ValueError, KeyError, TypeError, RecursionError, DCRError, OSError) as e:
            if obj.mtime is not None and now - obj.mtime >= GARBAGE_AFTER:
                out.garbage.append((obj.key, f"unreadable ({type(e).__name__}) and {now - obj.mtime:.0f} s old"))
            else:  # it may be a lease: gc never guesses in favour of deleting
                out.live.append(rid)
            continue
        if not math.isfinite(expires):
            out.garbage.append((obj.key, f"expires_at is {expires}, not a time"))
        elif expires > now + MAX_TTL + CLOCK_MARGIN:
            out.garbage.append((obj.key, f"expires_at is {expires - now:.0f} s ahead, beyond the {MAX_TTL:.0f} s "
                                "a lease may last"))
        elif expires + CLOCK_MARGIN > now:
            out.live.append(rid)
    out.live.sort()
    return out


def live(root: Root, step: int, now: float | None = None) -> list[str]:
    """The receivers holding a lease on ``step`` that gc honours (``scan``)."""
    return scan(root, step, now).live


def _is_receiver_id(name: str) -> bool:
    try:
        layout.check_receiver(name)
    except UsageError:
        return False
    return True
