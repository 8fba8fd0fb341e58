"""The commands that only read the bucket: ``dcr ls``, ``dcr show``, ``dcr status``, ``dcr verify``
(``--file PATH``: a local file against a step).
None of them imports torch or Prefect (but ``dcr verify --workers``, a Prefect flow), nor pydantic but ``dcr status``
for the fleets' records it shows (``storage.fleet``); ``dcr gc``, with typed options and an orchestrator, is ``flows.cli.gc``."""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict

from dcr_core.errors import IntegrityError, UsageError
from dcr_core.text import plural, printable
from flows.cli.common import add_common, add_workers, say, step_arg, storage_options
from flows.cli.progress import shown
from flows.maintenance.audit import VerifyReport, format_rows, list_steps, verify
from flows.maintenance.inspect import (
    format_fleets,
    format_history,
    format_status,
    format_step,
    receiver_history,
    receiver_status,
    show_step,
)
from flows.maintenance.verify_file import verify_file
from flows.workers import parse_workers
from storage import layout
from storage.catalog import require_published
from storage.root import open_root


def add_arguments(name: str, p) -> None:
    add_common(p)
    if name in ("ls", "status", "verify"):
        p.add_argument("--allow-empty", action="store_true",
                       help="a ROOT where nothing was published yet is not an error (exit 0, no steps); without it, "
                       "a missing or empty ROOT exits 2 naming the path")
    if name == "show":
        p.add_argument("--step", type=step_arg, required=True, metavar="N", help="the committed step to show")
        p.add_argument("--digests", action="store_true", help="also print each tensor's digest")
    elif name == "status":
        p.add_argument("--receiver", default=None, metavar="ID",
                       help="show this receiver's history instead: every refit it recorded on steps ROOT still holds")
    elif name == "verify":
        p.add_argument("--step", type=step_arg, default=None, metavar="N", help="verify only step N (default: every committed step)")
        p.add_argument("--deep", action="store_true", help="also replay every delta from its restart point and check tensor digests")
        p.add_argument("--file", default=None, metavar="PATH",
                       help="instead, say whether the local file (or directory) PATH is exactly step N (--step): the "
                       "published file's bytes (header and tensors), hashed here against the manifest; exit 5 naming "
                       "the first difference")
        add_workers(p, "check each step's tensors")


def run(name: str, args) -> int:
    so = storage_options(args)
    root = open_root(args.root, so)
    # --allow-empty takes an empty ROOT, not a local directory that does not exist (a typo)
    if not getattr(args, "allow_empty", False) or (root.backend.local and not os.path.isdir(root.path)):
        require_published(root)
    if name == "ls":
        rows = list_steps(open_root(args.root, so))
        say(args, format_rows(rows), [asdict(r) for r in rows])
        return 0
    if name == "show":
        view = show_step(open_root(args.root, so), args.step)
        say(args, format_step(view, args.digests), asdict(view))
        return 0
    if name == "status":
        root = open_root(args.root, so)
        if args.receiver is not None:
            records = receiver_history(root, layout.check_receiver(args.receiver))
            say(args, format_history(args.receiver, records), records)
            return 0
        latest, rows = receiver_status(root)
        from storage import fleet  # noqa: PLC0415 - pydantic: ls and verify start without it

        names = fleet.names(root)
        fleets = [f for f in (fleet.read(root, n) for n in names) if f is not None]
        switching = {n: lease for n in names if (lease := fleet.lease_holder(root, n)) is not None}
        now = time.time()
        text = "\n".join(filter(None, [format_status(latest, rows, now), format_fleets(fleets, switching, now)]))
        say(args, text, {"latest": latest, "receivers": [asdict(r) for r in rows],
                         "fleets": [{**f.model_dump(), "age_seconds": max(0.0, now - f.at)} for f in fleets],
                         "switching": {n: lease.model_dump() for n, lease in switching.items()}})
        return 0
    if name == "verify" and args.file is not None:
        if args.step is None or args.deep or args.workers is not None:
            raise UsageError("verify --file PATH compares PATH with one step: give --step N (and no --deep or --workers)")
        verdict = verify_file(root, args.step, args.file)
        if not verdict.exact:
            print(f"dcr: verify: {printable(verdict.message())}", file=sys.stderr)
            if args.json:
                print(json.dumps(asdict(verdict), indent=1), flush=True)
            return IntegrityError.exit_code
        say(args, verdict.message(), asdict(verdict))
        return 0
    if name == "verify":
        with shown(args, "verify"):
            if parse_workers(args.workers) is not None:
                from flows.cli.orchestrated import run_flow  # noqa: PLC0415 - Prefect only when asked for

                report = VerifyReport(**run_flow(args, "verify_refit", args.root, args.step, args.deep, so,
                                                 args.io_workers, workers=args.workers))
            else:
                report = verify(open_root(args.root, so), args.step, deep=args.deep, workers=args.io_workers)
        for err in report.errors:
            print(f"dcr: verify: {err}", file=sys.stderr)
        status = "FAILED" if report.errors else "ok"
        deep = f", {plural(len(report.replayed), 'delta')} replayed from their restart points" if args.deep else ""
        say(
            args,
            f"verify {status}: {plural(len(report.steps), 'step')}, {plural(report.chunks, 'chunk')}, "
            f"{plural(report.bytes, 'byte')} checked{deep}"
            + (f", {plural(len(report.errors), 'error')}" if report.errors else ""),
            asdict(report),
        )
        return IntegrityError.exit_code if report.errors else 0
    raise AssertionError(f"not a bucket command: {name}")
