"""``dcr receive ROOT --receiver ID --state PATH [--step N] [--fallback-root UPSTREAM]`` and ``dcr materialize ROOT --step N --out PATH``."""

from __future__ import annotations

import sys

from dcr_core.errors import UsageError
from dcr_core.text import plural
from flows.cli.common import (
    add_common,
    add_workers,
    from_model,
    model_default,
    say,
    step_arg,
    storage_options,
    use_prefect,
)
from flows.cli.progress import shown
from flows.cli.values import MIN_POLL_INTERVAL, POLL_INTERVAL, Number
from flows.options import ReceiveOptions
from flows.receive.follow import follow
from flows.receive.nearest import receive_nearest
from flows.receive.pipeline import run_materialize, run_receive
from flows.results import as_dict
from flows.streaming import FOLLOW_INTERVAL, Streaming
from flows.workers import parse_workers
from storage import leases
from storage.held_chunks import DEFAULT_BUDGET
from storage.root import RootRef, parse_storage_options

STREAM_MIB = DEFAULT_BUDGET / (1 << 20)  # --stream-memory's default: the prefetch budget's, in MiB


def add_arguments(name: str, p) -> None:
    if name == "materialize":
        add_common(p)
        p.add_argument("--step", type=step_arg, default=None, metavar="N", help="default: the latest committed step")
        p.add_argument("--out", required=True, metavar="PATH",
                       help="the .safetensors file to write: for a step published from a safetensors file, that "
                       "file byte for byte; for one published from a sharded directory, a directory (its files and "
                       "index, byte for byte) unless PATH ends in .safetensors")
        p.add_argument("--as-state", action="store_true",
                       help="write a file in DCR's state format instead (the step's tensors with dcr.* metadata, as "
                       "dcr receive keeps; what steps published from tensors or shards always give)")
        p.add_argument("--force", action="store_true",
                       help="replace PATH even if DCR did not write it (by default only a materialization or a "
                       "receiver state is replaced: a trainer's checkpoint named by mistake is kept)")
        add_workers(p, "rebuild the tensors (the workers must see PATH's directory)")
        return
    add_common(p, orchestrated=True)
    p.add_argument("--receiver", required=True, metavar="ID",
                   help="this receiver's id (letters, digits, '.', '_', '-'): its record in ROOT and its leases")
    p.add_argument("--state", required=True, metavar="PATH",
                   help="the receiver's .safetensors state file (created from the nearest keyframe if absent)")
    p.add_argument("--step", type=step_arg, default=None, metavar="N",
                   help="the step to bring PATH to, forward or backward (default: the latest committed step)")
    p.add_argument("--fallback-root", action="append", default=[], metavar="UPSTREAM",
                   help="a ROOT to fall back to, in order, when ROOT (a mirror, say) lags or fails (repeatable)")
    p.add_argument("--fallback-storage-option", action="append", default=[], metavar="KEY=VALUE",
                   help="fsspec option for the fallback ROOTs (repeatable; --storage-option applies to ROOT only)")
    p.add_argument("--follow", action="store_true", help="keep polling ROOT and apply every newly committed step")
    p.add_argument("--interval", type=POLL_INTERVAL, default=FOLLOW_INTERVAL,
                   help=f"seconds between polls with --follow (default {FOLLOW_INTERVAL:g}, at least {MIN_POLL_INTERVAL:g})")
    p.add_argument("--until-step", type=step_arg, default=None, help="with --follow: exit once at this step or later")
    p.add_argument("--stream", action="store_true",
                   help="with --follow: fetch and verify each step's chunks while it is being published (applied "
                   "only after its commit); --interval is then also how soon a new publish is noticed")
    p.add_argument("--stream-memory", type=Number(float, 0, lo_open=True, unit="MiB"), default=STREAM_MIB, metavar="MIB",
                   help=f"with --stream: stored bytes of prefetched chunks held at once, in MiB (default {STREAM_MIB:g})")
    p.add_argument("--max-staleness", type=Number(float, 0, lo_open=True, unit="seconds"), metavar="SECONDS",
                   default=model_default(ReceiveOptions, "max_staleness"),
                   help="refuse ROOT (a mirror frozen at an old step, say) when its newest signed heartbeat is older "
                   "than SECONDS (publishers write one per commit; dcr heartbeat renews it between commits)")
    p.add_argument("--require-signed", action="store_true", help=ReceiveOptions.model_fields["require_signed"].description)
    p.add_argument("--lease-seconds", type=Number(float, 0, leases.MAX_TTL, lo_open=True, unit="seconds"),
                   **from_model(ReceiveOptions, "lease_seconds", help="how long dcr gc keeps the steps a refit reads, "
                                f"at most {leases.MAX_TTL:g}; released when done"))
    add_workers(p, "rewrite the state file (the workers must see PATH's directory; not with --in-place, --follow)")
    p.add_argument(
        "--in-place", action="store_true",
        help="patch the state file in place (a journal; writes only the changed elements) instead of "
        "rewriting it; readers must not read the file while a receive runs",
    )


def receive_options(name: str, args) -> ReceiveOptions:
    if name == "materialize":
        return ReceiveOptions(io_workers=args.io_workers, as_state=args.as_state)
    return ReceiveOptions(io_workers=args.io_workers, in_place=args.in_place, lease_seconds=args.lease_seconds,
                          max_staleness=args.max_staleness, require_signed=args.require_signed)


def run(name: str, args) -> int:
    so = storage_options(args)
    options = receive_options(name, args)
    if name == "materialize":
        with shown(args, "materialize"):
            if parse_workers(args.workers) is not None:
                from flows.cli.orchestrated import run_flow  # noqa: PLC0415 - Prefect only when asked for

                res = run_flow(args, "materialize_refit", args.root, args.step, args.out, so, options,
                               workers=args.workers, force=args.force)
            else:
                res = as_dict(run_materialize(args.root, args.step, args.out, so, options, force=args.force))
        say(args, f"wrote step {res['step']} to {args.out}", res)
        return 0
    workers = parse_workers(args.workers)
    if workers is not None and (args.follow or args.in_place):
        raise UsageError("--workers rewrites the state file once (a Prefect flow on a Dask cluster); not with "
                         f"{'--follow' if args.follow else '--in-place'}")
    if args.fallback_root:
        if args.follow or use_prefect(args) or workers is not None:
            raise UsageError("--fallback-root works with one-shot, in-process receives (not with --follow or Prefect yet)")
        fallback_opts = parse_storage_options(args.fallback_storage_option)
        roots = [RootRef(args.root, so), *(RootRef(r, fallback_opts) for r in args.fallback_root)]

        def warn_root(message: str) -> None:
            print(f"dcr: receive: {message}", file=sys.stderr, flush=True)

        with shown(args, f"receive {args.receiver}"):
            res = as_dict(receive_nearest(roots, args.receiver, args.state, args.step, options, warn_root))
        how = ", ".join(res["moves"]) or "already there"
        say(args, f"receiver {args.receiver} at step {res['step']} ({how}; pulled {plural(res['bytes_pulled'], 'byte')})", res)
        return 0
    if use_prefect(args) or workers is not None:
        from flows.cli.orchestrated import run_flow  # noqa: PLC0415 - Prefect only when asked for

        def receive_now(step):
            return run_flow(args, "receive_refit", args.root, args.receiver, args.state, step, so, options,
                            workers=args.workers)
    else:
        def receive_now(step):
            return as_dict(run_receive(args.root, args.receiver, args.state, step, so, options))

    def receive(step):
        with shown(args, f"receive {args.receiver}"):
            return receive_now(step)

    def report(res: dict) -> None:
        how = ", ".join(res["moves"]) or "already there"
        early = ""
        if args.follow and args.stream and stream.last is not None and stream.last["step"] == res["step"]:
            res = {**res, "prefetched": stream.last}
            early = (f"; {plural(stream.last['chunks'], 'chunk')} ({plural(stream.last['bytes'], 'byte')}) "
                     "fetched before the commit")
        pulled = plural(res["bytes_pulled"], "byte")
        say(args, f"receiver {args.receiver} at step {res['step']} ({how}; pulled {pulled}{early})", res)

    stream = None
    if not args.follow:
        if args.stream:
            raise UsageError("--stream works with --follow (it fetches the step being published while waiting for it)")
        report(receive(args.step))
        return 0
    if args.step is not None:
        raise UsageError("--follow applies every new step; it takes no --step (use --until-step)")
    stream = Streaming(RootRef(args.root, so), args.io_workers, int(args.stream_memory * (1 << 20))) \
        if args.stream else None
    def warn(message: str) -> None:
        print(f"dcr: receive: {message}", file=sys.stderr, flush=True)

    for res in follow(RootRef(args.root, so), args.state, receive, args.interval, args.until_step, warn, stream,
                      args.max_staleness):
        report(res)
    return 0
