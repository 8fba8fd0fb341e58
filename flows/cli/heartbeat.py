"""``dcr heartbeat ROOT [--every SECONDS]``: renew the run's signed heartbeat (``storage.heartbeat``).

A publisher writes one with every commit; between commits (a long optimizer step, an evaluation)
run this beside the trainer so receivers that ask for ``--max-staleness`` keep trusting the ROOT
and its mirrors. With ``--every`` it renews until interrupted. A renewal never goes backwards: it
refuses to name a step older than the previous heartbeat named (in the bucket, or written by this
loop) unless that step was retracted, naming both (exit 5)."""

from __future__ import annotations

import time

from dcr_core.errors import UsageError
from flows.cli.common import add_common, say, storage_options
from flows.cli.values import MIN_POLL_INTERVAL, POLL_INTERVAL
from storage import heartbeat, signing
from storage.catalog import Catalog, require_published
from storage.root import open_root


def add_arguments(name: str, p) -> None:
    add_common(p)
    p.add_argument("--every", type=POLL_INTERVAL, default=None, metavar="SECONDS",
                   help=f"renew it every SECONDS (at least {MIN_POLL_INTERVAL:g}) until interrupted (default: once)")


def run(name: str, args) -> int:
    root = open_root(args.root, storage_options(args))
    require_published(root)
    key = signing.publisher_key()
    last = None  # the heartbeat this loop wrote last: the next may not go behind it either
    while True:
        the_run = Catalog(root).root_run(fresh=True)
        if key is None and the_run is not None and the_run.signed is not None:
            raise UsageError(f"{root.url}: its steps are signed, so its heartbeat must be too; set "
                             f"{signing.ENV_KEY_FILE} (or {signing.ENV_KEY}) to the publisher's key")
        hb = last = heartbeat.beat(root, key, scan=True, floor=last)
        say(args, f"heartbeat of {root.url}: latest step {hb.latest_step}, at {hb.body()['at_utc']}"
            + (" (signed)" if hb.signature else ""), hb.body())
        if args.every is None:
            return 0
        time.sleep(args.every)
