"""``dcr gc ROOT --keep-last K [--grace-seconds S] [--dry-run]``: delete steps and attempts that
retention no longer needs, in-process or as a Prefect flow run. Apart from the read-only bucket
commands (``flows.cli.bucket``) because its options are typed (pydantic), which they do not need."""

from __future__ import annotations

from dataclasses import asdict

from dcr_core.errors import UsageError
from flows.cli.common import add_common, from_model, say, storage_options, use_prefect
from flows.cli.values import Number
from flows.maintenance.gc import GcReport, format_report, run_gc
from flows.options import GcOptions
from storage.catalog import Catalog, missing_root
from storage.root import open_root


def add_arguments(name: str, p) -> None:
    add_common(p, orchestrated=True)
    p.add_argument(
        "--keep-last", type=Number(int, 1), default=None, metavar="K",
        help="keep the newest K committed steps (and the chains to rebuild them); registered receivers' "
        "steps and the deltas they need are always kept (required, except with --dry-run, which then "
        "keeps every committed step and shows only the attempts that would go)",
    )
    p.add_argument("--grace-seconds", type=Number(float, 0, unit="seconds"), **from_model(GcOptions, "grace_seconds"))
    p.add_argument("--dry-run", action="store_true", help="print what would be deleted; delete nothing")


def run(name: str, args) -> int:
    so = storage_options(args)
    missing = missing_root(open_root(args.root, so))  # a typo, not a ROOT with nothing to collect
    if missing is not None:
        raise missing
    keep_last = args.keep_last
    if keep_last is None:
        if not args.dry_run:
            raise UsageError("dcr gc needs --keep-last K (or --dry-run to see what would go)")
        keep_last = max(1, len(Catalog(open_root(args.root, so)).committed_steps()))
    options = GcOptions(keep_last=keep_last, grace_seconds=args.grace_seconds, dry_run=args.dry_run)
    if use_prefect(args):
        from flows.cli.orchestrated import run_flow  # noqa: PLC0415 - Prefect only when asked for

        data = run_flow(args, "gc_refit", args.root, options, so)
        report = GcReport.from_dict(data)
    else:
        report = run_gc(args.root, options, so)
    say(args, format_report(report), asdict(report))
    return 0
