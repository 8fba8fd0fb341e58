"""``dcr heartbeat ROOT [--every SECONDS]``: renew the run's signed heartbeat (``storage.heartbeat``).

A publisher writes one with every commit; between commits (a long optimizer step, an evaluation)
run this beside the trainer so receivers that ask for ``--max-staleness`` keep trusting the ROOT
and its mirrors. With ``--every`` it renews until interrupted."""

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
    while True:
        cat = Catalog(root)
        the_run = cat.root_run(fresh=True)
        if key is None and the_run is not None and the_run.signed is not None:
            raise UsageError(f"{root.url}: its steps are signed, so its heartbeat must be too; set "
                             f"{signing.ENV_KEY_FILE} (or {signing.ENV_KEY}) to the publisher's key")
        hb = heartbeat.beat(root, None if the_run is None else the_run.run_id, cat.latest_committed(), key)
        say(args, f"heartbeat of {root.url}: latest step {hb.latest_step}, at {hb.body()['at_utc']}"
            + (" (signed)" if hb.signature else ""), hb.body())
        if args.every is None:
            return 0
        time.sleep(args.every)
