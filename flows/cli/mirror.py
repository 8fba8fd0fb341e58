"""``dcr mirror SRC DST [--step N] [--follow]``: copy committed steps to another ROOT (a relay tree)."""

from __future__ import annotations

import sys
import time
from dataclasses import asdict

from dcr_core.errors import UsageError
from flows.cli.common import add_common, say, step_arg, storage_options
from flows.maintenance.mirror import run_mirror
from flows.receive.follow import worth_retrying
from storage.root import parse_storage_options


def add_arguments(name: str, p) -> None:
    add_common(p)  # ROOT is SRC, the upstream
    p.add_argument("dst", metavar="DST", help="the downstream ROOT (created if absent): committed steps only, marker last")
    p.add_argument("--dst-storage-option", action="append", default=[], metavar="KEY=VALUE",
                   help="fsspec option for DST only (repeatable; --storage-option applies to SRC only): SRC and DST "
                   "may be different servers with different credentials")
    p.add_argument("--step", type=step_arg, default=None, metavar="N", help="mirror only step N (default: every committed step)")
    p.add_argument("--as", dest="as_id", default=None, metavar="ID",
                   help="register the mirror in SRC as receiver ID (leases while copying, its position after): "
                   "gc in SRC then keeps what the mirror still needs; needs write access to SRC's receivers/ and leases/")
    p.add_argument("--follow", action="store_true", help="keep mirroring steps as they are committed upstream")
    p.add_argument("--interval", type=float, default=5.0, help="with --follow: seconds between looks upstream (default 5)")


def run(name: str, args) -> int:
    if args.follow and args.step is not None:
        raise UsageError("--follow mirrors every new step; it takes no --step")
    src_opts = storage_options(args)
    dst_opts = parse_storage_options(args.dst_storage_option)
    backoff = args.interval
    while True:
        try:
            r = run_mirror(args.root, args.dst, args.step, src_opts, dst_opts, as_id=args.as_id)
        except Exception as e:
            if not args.follow or not worth_retrying(e):
                raise
            print(f"dcr: mirror: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}; retrying in "
                  f"{backoff:.1f} s", file=sys.stderr, flush=True)
            time.sleep(backoff)
            backoff = min(60.0, backoff * 2)
            continue
        backoff = args.interval
        if r.copied_steps or not args.follow:
            say(args, f"mirrored steps {r.copied_steps or 'none'} ({r.objects_copied} objects, {r.bytes_copied} bytes); "
                f"already there: {len(r.present_steps)}", asdict(r))
        if not args.follow:
            return 0
        time.sleep(args.interval)
