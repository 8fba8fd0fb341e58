"""``dcr report ROOT --out DIR``: the run as a static HTML page with figures (needs matplotlib)."""

from __future__ import annotations

from dcr_core.errors import UsageError
from dcr_core.text import plural
from flows.cli.common import add_common, say, storage_options
from flows.maintenance.report import build_report
from storage.catalog import require_published
from storage.root import open_root

try:
    from flows.maintenance.report_page import FIGURES, render
except ImportError as e:  # matplotlib is the "report" extra
    render, FIGURES, _missing = None, (), e
else:
    _missing = None


def add_arguments(name: str, p) -> None:
    add_common(p)
    p.add_argument("--out", required=True, metavar="DIR",
                   help="where to write index.html, its figures (PNG) and report.json (created if absent)")


def run(name: str, args) -> int:
    if render is None:
        raise UsageError(f"dcr report needs matplotlib ({_missing}); pip install 'dcr[report]'")
    root = open_root(args.root, storage_options(args))
    require_published(root)
    report = build_report(root)
    page = render(report, args.out)
    say(args, f"wrote {page} ({plural(len(report.steps), 'step')}, {plural(len(report.receivers), 'receiver')}; figures: "
        f"{', '.join(FIGURES)})", {"page": page, "steps": len(report.steps), "receivers": len(report.receivers)})
    return 0
