"""``dcr cache ls`` and ``dcr cache prune [--max-bytes B]``: DCR's local cache (``storage.local.cache``)."""

from __future__ import annotations

import argparse
import time
from dataclasses import asdict

from dcr_core.errors import UsageError
from dcr_core.text import plural, printable
from flows.cli.common import say
from flows.maintenance.audit import human_bytes
from flows.options import default_cache_dir
from storage.local import cache


def add_arguments(name: str, p) -> None:
    p.add_argument("action", choices=("ls", "prune"), help="ls: what the cache holds; prune: delete entries down to a bound")
    p.add_argument("--cache-dir", default=None, metavar="DIR",
                   help="the cache (default: $DCR_CACHE_DIR, else $XDG_CACHE_HOME/dcr, else ~/.cache/dcr)")
    p.add_argument("--max-bytes", type=_size, default=None, metavar="B",
                   help="prune: the bound, in bytes or with K/M/G/T (default: $DCR_CACHE_MAX_BYTES, else "
                   f"{cache.DEFAULT_MAX_BYTES >> 30} GiB); entries whose local ROOT is gone always go")
    p.add_argument("--dry-run", action="store_true", help="prune: say what would be deleted, delete nothing")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("-q", "--quiet", action="store_true", help="print nothing on success")


def _size(text: str) -> int:
    try:
        return cache.parse_size(text, "--max-bytes")
    except UsageError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def run(name: str, args) -> int:
    cache_dir = args.cache_dir or default_cache_dir()
    if args.action == "ls":
        found = cache.entries(cache_dir)
        say(args, _table(cache_dir, found), {"cache_dir": cache_dir, "entries": [asdict(e) for e in found],
                                             "bytes": sum(e.nbytes for e in found)})
        return 0
    report = cache.prune(cache_dir, args.max_bytes, dry_run=args.dry_run)
    verb = "would remove" if args.dry_run else "removed"
    lines = [f"{verb} {printable(r['path'])} ({human_bytes(r['nbytes'])}): {printable(r['why'])}" for r in report.removed]
    lines += [f"kept {printable(p)}: in use" for p in report.skipped]
    lines.append(f"cache {cache_dir}: {human_bytes(report.before)} -> {human_bytes(report.after)} "
                 f"(bound {human_bytes(report.max_bytes)})")
    say(args, "\n".join(lines), asdict(report))
    return 0


def _table(cache_dir: str, found: list[cache.Entry]) -> str:
    if not found:
        return f"cache {cache_dir}: empty"
    lines = [f"{'SIZE':>10}  {'LAST USED':<16}  {'KIND':<18}  {'STEP':>6}  ROOT / PATH"]
    for e in found:
        where = printable(e.root or "(unreadable header)") + (" (gone)" if e.orphan else "")
        lines.append(f"{human_bytes(e.nbytes):>10}  {time.strftime('%Y-%m-%d %H:%M', time.localtime(e.last_used)):<16}  "
                     f"{e.kind:<18}  {'-' if e.step is None else e.step:>6}  {where}\n{'':>60}{printable(e.path)}")
    lines.append(f"cache {cache_dir}: {human_bytes(sum(e.nbytes for e in found))} in {plural(len(found), 'entry', 'entries')} "
                 f"(bound {human_bytes(cache.max_bytes_setting())}: dcr cache prune)")
    return "\n".join(lines)
