"""``dcr mirror SRC DST [--step N] [--follow]``: copy committed steps to another ROOT (a relay tree)."""

from __future__ import annotations

import sys
import time
from dataclasses import asdict

from dcr_core import events
from dcr_core.errors import UsageError
from dcr_core.text import plural
from flows.cli.common import add_common, add_workers, say, step_arg, storage_options
from flows.cli.values import MIN_POLL_INTERVAL, POLL_INTERVAL
from flows.maintenance.mirror import MirrorResult, run_mirror
from flows.maintenance.mirror_stream import Forwarder
from flows.receive.follow import worth_retrying
from flows.streaming import FOLLOW_INTERVAL, Streaming
from flows.workers import parse_workers
from storage.catalog import Catalog
from storage.root import RootRef, open_root, parse_storage_options


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
    p.add_argument("--interval", type=POLL_INTERVAL, default=FOLLOW_INTERVAL,
                   help=f"with --follow: seconds between looks upstream (default {FOLLOW_INTERVAL:g}, at least "
                   f"{MIN_POLL_INTERVAL:g})")
    p.add_argument("--stream", action="store_true",
                   help="with --follow: forward each step's chunks downstream while it is published upstream (and "
                   "its stream indexes, so DST's followers stream too); the marker still follows the upstream commit")
    add_workers(p, "copy each step's objects")


def run(name: str, args) -> int:
    if args.follow and args.step is not None:
        raise UsageError("--follow mirrors every new step; it takes no --step")
    if args.stream and not args.follow:
        raise UsageError("--stream works with --follow (it forwards the step being published upstream)")
    workers = parse_workers(args.workers)
    if workers is not None and args.follow:
        raise UsageError("--workers copies one round of steps (a Prefect flow on a Dask cluster); it does not "
                         "--follow yet: run it again, or follow without --workers")
    src_opts = storage_options(args)
    dst_opts = parse_storage_options(args.dst_storage_option)
    dst = RootRef(args.dst, dst_opts)
    stream = None
    if args.stream:
        stream = Streaming(RootRef(args.root, src_opts), args.io_workers,
                           start=lambda src, step, attempt, workers, trusted: Forwarder(src, open_root(dst), step,
                                                                                        attempt, workers, trusted))
    backoff = args.interval
    while True:
        try:
            if workers is not None:
                from flows.cli.orchestrated import run_flow  # noqa: PLC0415 - Prefect only when asked for

                r = MirrorResult(**run_flow(args, "mirror_refit", args.root, args.dst, args.step, src_opts, dst_opts,
                                            args.as_id, args.io_workers, workers=args.workers))
            else:
                r = run_mirror(args.root, args.dst, args.step, src_opts, dst_opts, as_id=args.as_id,
                               io_workers=args.io_workers)
            if stream is not None:
                stream.done(max(r.copied_steps + r.present_steps))
        except Exception as e:
            if not args.follow or not worth_retrying(e):
                raise
            print(f"dcr: mirror: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}; retrying in "
                  f"{backoff:.1f} s", file=sys.stderr, flush=True)
            time.sleep(backoff)
            backoff = min(60.0, backoff * 2)
            continue
        backoff = args.interval
        if r.copied_steps or r.retracted_steps or not args.follow:
            retracted = f"; retracted as upstream: {r.retracted_steps}" if r.retracted_steps else ""
            copied = f"{plural(r.objects_copied, 'object')}, {plural(r.bytes_copied, 'byte')}"
            say(args, f"mirrored steps {r.copied_steps or 'none'} ({copied}){retracted}; "
                f"already there: {len(r.present_steps)}", asdict(r))
        if not args.follow:
            return 0
        events.reached("follow.waiting", held=max(r.copied_steps + r.present_steps, default=None))
        if stream is None:
            time.sleep(args.interval)
            continue
        _wait_streaming(stream, dst, args.interval)


def _wait_streaming(stream: Streaming, dst: RootRef, interval: float) -> None:
    """Until the next look upstream: forward what upstream announces; wake early on its commit."""
    deadline = time.monotonic() + interval
    while time.monotonic() < deadline:
        stream.watch(Catalog(open_root(dst)).latest_committed())
        stream.sleep(min(interval, 0.25))
        if stream.current is not None and stream.current.committed.is_set():
            return
