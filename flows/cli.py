"""The ``dcr`` command line: publish, receive, materialize, ls, verify, gc, demo, bench.

Errors print one line (``dcr: error: ...``) and exit non-zero; set ``DCR_DEBUG=1`` for a traceback.
Orchestration: ``--orchestrator prefect`` runs the Prefect flows (tracked by the Prefect API),
``none`` runs the same pipeline in-process; ``auto`` (default) picks Prefect when
``PREFECT_API_URL`` is set. Without a server, a Prefect run first starts a temporary API server.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict

from dcr_core.errors import DCRError, UsageError


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--storage-option", action="append", default=[], metavar="KEY=VALUE",
        help="extra fsspec option for ROOT (repeatable), e.g. endpoint_url=http://127.0.0.1:9000",
    )
    p.add_argument(
        "--orchestrator", choices=("auto", "prefect", "none"),
        default=os.environ.get("DCR_ORCHESTRATOR", "auto"),
        help="run as Prefect flows or in-process (default auto: Prefect if PREFECT_API_URL is set)",
    )
    p.add_argument("--io-workers", type=int, default=8, help="parallel object reads/writes (default 8)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("-q", "--quiet", action="store_true", help="print nothing on success")


def _step(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"step must be a non-negative integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"step must be a non-negative integer, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dcr", description="Bit-exact delta-compressed refit through object storage.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("publish", help="publish a checkpoint as step N (keyframe or delta)")
    p.add_argument("root")
    p.add_argument("checkpoint")
    p.add_argument("--step", type=_step, required=True)
    p.add_argument("--keyframe", action="store_true", help="store a full snapshot and start a new lineage")
    p.add_argument(
        "--dcp-prefix", default=None, metavar="PREFIX",
        help="CHECKPOINT is a torch.distributed.checkpoint directory: publish only tensors named PREFIX..., "
        "without the prefix (e.g. model.)",
    )
    p.add_argument("--chunk-bytes", type=int, default=None, help="raw bytes per chunk (default 4 MiB)")
    p.add_argument("--no-cache", action="store_true", help="rebuild the baseline from ROOT instead of the local cache")
    p.add_argument(
        "--keyframe-every", type=int, default=0, metavar="K",
        help="keyframe policy: make this step a keyframe once K steps passed since the lineage's keyframe",
    )
    p.add_argument(
        "--keyframe-above", type=float, default=0.0, metavar="F",
        help="keyframe policy: make this step a keyframe once the stored delta bytes since the lineage's "
        "keyframe exceed F times the full size (e.g. 0.5)",
    )
    p.add_argument(
        "--codec", choices=("sparse", "blosc"), default="sparse",
        help="delta codec: sparse (default, near the entropy bound; stock zarr reads it with this package "
        "installed) or blosc (standard Zarr codec only, about 1.6x the bytes)",
    )
    _add_common(p)

    p = sub.add_parser("receive", help="bring a receiver's state file to step N (default latest)")
    p.add_argument("root")
    p.add_argument("--receiver", required=True)
    p.add_argument("--state", required=True)
    p.add_argument("--step", type=_step, default=None)
    p.add_argument("--follow", action="store_true", help="keep polling ROOT and apply every newly committed step")
    p.add_argument("--interval", type=float, default=5.0, help="seconds between polls with --follow (default 5)")
    p.add_argument("--until-step", type=_step, default=None, help="with --follow: exit once at this step or later")
    p.add_argument(
        "--in-place", action="store_true",
        help="patch the state file in place (undo journal; writes only the changed elements) instead of "
        "rewriting it; readers must not read the file while a receive runs",
    )
    _add_common(p)

    p = sub.add_parser("materialize", help="write the full checkpoint of step N")
    p.add_argument("root")
    p.add_argument("--step", type=_step, default=None, help="default: the latest committed step")
    p.add_argument("--out", required=True)
    _add_common(p)

    p = sub.add_parser("ls", help="one row per step")
    p.add_argument("root")
    _add_common(p)

    p = sub.add_parser("verify", help="re-read stored payloads and check their digests")
    p.add_argument("root")
    p.add_argument("--step", type=_step, default=None)
    p.add_argument("--deep", action="store_true", help="also replay every delta and check tensor digests")
    _add_common(p)

    p = sub.add_parser("gc", help="delete steps and attempts that retention no longer needs")
    p.add_argument("root")
    p.add_argument(
        "--keep-last", type=int, required=True, metavar="K",
        help="keep the newest K committed steps (and the chains to rebuild them); registered receivers' "
        "steps and the deltas they need are always kept",
    )
    p.add_argument(
        "--grace-seconds", type=float, default=3600.0,
        help="leave uncommitted attempts younger than this alone: a publisher may still be writing them (default 3600)",
    )
    p.add_argument("--dry-run", action="store_true", help="print what would be deleted; delete nothing")
    _add_common(p)

    sub.add_parser("demo", help="train a small model and refit two receivers after every step", add_help=False)
    sub.add_parser("bench", help="benchmark DCR against peer baselines (JSON, markdown, plots)", add_help=False)
    return parser


def _use_prefect(args) -> bool:
    if args.orchestrator == "prefect":
        return True
    return args.orchestrator == "auto" and bool(os.environ.get("PREFECT_API_URL"))


def _print(args, human: str, data) -> None:
    if args.quiet:
        return
    if args.json:
        print(json.dumps(data, indent=1, default=str))
    else:
        print(human)


def cmd_publish(args, so) -> int:
    from flows.options import PublishOptions
    from flows.pipeline import run_publish

    from dcr_core.retention import KeyframePolicy
    from flows.options import BLOSC_DELTAS, SPARSE_DELTAS

    kw = {"io_workers": args.io_workers, "use_cache": not args.no_cache,
          "delta_codec": SPARSE_DELTAS if args.codec == "sparse" else BLOSC_DELTAS}
    if args.chunk_bytes:
        kw["chunk_bytes"] = args.chunk_bytes
    kw["keyframe_policy"] = KeyframePolicy(every=args.keyframe_every, above=args.keyframe_above)
    options = PublishOptions(**kw)
    from flows.dcp_source import dcp_sources, is_dcp_dir
    from flows.layout_source import is_layout_file, layout_sources

    if is_dcp_dir(args.checkpoint):  # a DCP directory: published from its shards, file by file
        source = dcp_sources(args.checkpoint, args.dcp_prefix)
    elif is_layout_file(args.checkpoint):  # per-rank safetensors files + a layout file
        source = layout_sources(args.checkpoint)
    elif args.dcp_prefix is not None:
        raise UsageError(f"{args.checkpoint}: --dcp-prefix needs a torch.distributed.checkpoint directory (with .metadata)")
    else:
        source = args.checkpoint
    if _use_prefect(args):
        from flows.prefect_flows import publish_refit

        res = publish_refit(args.root, source, args.step, args.keyframe, so, options)
    else:
        res = asdict(run_publish(args.root, source, args.step, args.keyframe, so, options))
    s = res["summary"]
    base = "" if res["base_step"] is None else f" against step {res['base_step']}"
    if res["kind"] == "keyframe" and s.get("keyframe_reason") not in (None, "requested", "first step"):
        base = f" by keyframe policy: {s['keyframe_reason']}"
    _print(
        args,
        f"committed step {res['step']} ({res['kind']}{base}): {s['tensors_changed']}/{s['tensors']} tensors changed, "
        f"change rate {100 * s['change_rate']:.3f}%, stored {s['bytes_stored']} of {s['bytes_full']} bytes",
        res,
    )
    return 0


def cmd_receive(args, so) -> int:
    from flows.options import ReceiveOptions
    from flows.pipeline import run_receive

    options = ReceiveOptions(io_workers=args.io_workers, in_place=args.in_place)
    if args.follow:
        from flows.follow import follow

        if args.step is not None:
            raise UsageError("--follow applies every new step; it takes no --step (use --until-step)")
        for res in follow(args.root, args.receiver, args.state, so, options, args.interval, args.until_step,
                          orchestrated=_use_prefect(args)):
            _print(args, f"receiver {args.receiver} at step {res['step']} ({', '.join(res['moves'])}; "
                   f"pulled {res['bytes_pulled']} bytes)", res)
            sys.stdout.flush()
        return 0
    if _use_prefect(args):
        from flows.prefect_flows import receive_refit

        res = receive_refit(args.root, args.receiver, args.state, args.step, so, options)
    else:
        res = asdict(run_receive(args.root, args.receiver, args.state, args.step, so, options))
    how = ", ".join(res["moves"]) or "already there"
    _print(args, f"receiver {args.receiver} at step {res['step']} ({how}; pulled {res['bytes_pulled']} bytes)", res)
    return 0


def cmd_materialize(args, so) -> int:
    from flows.options import ReceiveOptions
    from flows.pipeline import run_materialize

    res = asdict(run_materialize(args.root, args.step, args.out, so, ReceiveOptions(io_workers=args.io_workers)))
    _print(args, f"wrote step {res['step']} to {args.out}", res)
    return 0


def cmd_ls(args, so) -> int:
    from flows.audit import format_rows, list_steps
    from storage.root import Root

    rows = list_steps(Root(args.root, so))
    _print(args, format_rows(rows), [asdict(r) for r in rows])
    return 0


def cmd_verify(args, so) -> int:
    from flows.audit import verify
    from storage.root import Root

    report = verify(Root(args.root, so), args.step, deep=args.deep, workers=args.io_workers)
    for err in report.errors:
        print(f"dcr: verify: {err}", file=sys.stderr)
    status = "FAILED" if report.errors else "ok"
    _print(
        args,
        f"verify {status}: {len(report.steps)} steps, {report.chunks} chunks, {report.bytes} bytes checked"
        + (f", {len(report.errors)} errors" if report.errors else ""),
        asdict(report),
    )
    return 1 if report.errors else 0


def cmd_gc(args, so) -> int:
    from flows.gc import format_report, run_gc
    from storage.root import Root

    if args.grace_seconds < 0:
        raise UsageError(f"--grace-seconds must be >= 0, got {args.grace_seconds}")
    report = run_gc(Root(args.root, so), args.keep_last, args.grace_seconds, args.dry_run)
    _print(args, format_report(report), asdict(report))
    return 0


COMMANDS = {
    "gc": cmd_gc,
    "publish": cmd_publish,
    "receive": cmd_receive,
    "materialize": cmd_materialize,
    "ls": cmd_ls,
    "verify": cmd_verify,
}


def _return_freed_memory_to_the_os() -> None:
    """Make glibc serve large buffers with mmap (and give them back on free).

    DCR allocates and frees one tensor-sized buffer after another. glibc's default raises its mmap
    threshold after the first large free, and later tensor buffers then come from the heap, which
    is not returned to the OS: resident memory grows toward the model size although DCR holds one
    tensor at a time. A fixed threshold keeps resident memory at what is actually held. It is 8 MiB,
    above the 4 MiB default chunk: chunk-sized buffers (XOR masks, planes, decoded payloads) are
    reused from the heap instead of being mapped and faulted in afresh each time, which doubled the
    codec's throughput against a 1 MiB threshold (``dcr bench``, 100M BF16 at 5-10% changed) for
    about 7 MiB more resident memory (``tests/test_memory.py``).
    """
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 8 << 20)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    _return_freed_memory_to_the_os()
    if argv and argv[0] == "demo":
        from flows.demo import main as demo_main

        return demo_main(argv[1:])
    if argv and argv[0] == "bench":
        from flows.bench import main as bench_main

        return bench_main(argv[1:])
    args = build_parser().parse_args(argv)
    t0 = time.perf_counter()
    try:
        from storage.root import parse_storage_options

        so = parse_storage_options(args.storage_option)
        if args.io_workers < 1:
            raise UsageError(f"--io-workers must be >= 1, got {args.io_workers}")
        return COMMANDS[args.command](args, so)
    except DCRError as e:
        print(f"dcr: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("dcr: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # anything unexpected: still one line, unless debugging
        if os.environ.get("DCR_DEBUG"):
            raise
        first = str(e).splitlines()[0] if str(e) else ""
        print(f"dcr: error: {type(e).__name__}: {first}", file=sys.stderr)
        return 1
    finally:
        if os.environ.get("DCR_TIMING"):
            print(f"dcr: {args.command} took {time.perf_counter() - t0:.3f} s", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
