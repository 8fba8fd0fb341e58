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
"""

from __future__ import annotations

import json
import logging
import time

from dcr_core.errors import DCRError
from storage import layout
from storage.root import Root

log = logging.getLogger("dcr.storage")

DEFAULT_TTL = 3600.0
CLOCK_MARGIN = 60.0  # gc honours a lease this long past its expiry
MAX_LEASE_BYTES = 4096


def take(root: Root, receiver_id: str, steps: list[int], target: int, ttl: float = DEFAULT_TTL) -> None:
    """Lease ``steps`` for ``receiver_id`` for ``ttl`` seconds (overwrites its earlier leases)."""
    body = json.dumps({"receiver": receiver_id, "expires_at": time.time() + ttl, "target": target}).encode()
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


def live(root: Root, step: int, now: float | None = None) -> list[str]:
    """The receivers holding a lease on ``step`` that has not expired (unreadable leases count as
    live: gc must not guess in favour of deleting)."""
    now = time.time() if now is None else now
    out = []
    for name in root.listdir(layout.leases_dir(step)):
        if not name.endswith(".json"):
            continue
        try:
            d = json.loads(root.read(f"{layout.leases_dir(step)}/{name}", limit=MAX_LEASE_BYTES))
            expires = float(d["expires_at"])
        except FileNotFoundError:
            continue  # released meanwhile
        except (ValueError, KeyError, TypeError, RecursionError, DCRError, OSError):
            out.append(name[: -len(".json")])
            continue
        if expires + CLOCK_MARGIN > now:
            out.append(name[: -len(".json")])
    return sorted(out)
