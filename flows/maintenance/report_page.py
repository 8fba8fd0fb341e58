"""``dcr report ROOT --out DIR``: a run as a static page, ``DIR/index.html`` with three figures
(``bytes.png``, ``change_rate.png``, ``lag.png``) and ``report.json`` (the data behind them).

The page needs nothing but a browser: no script from elsewhere, images beside it, every number also
in a table. matplotlib draws the figures (the ``report`` extra: ``pip install 'dcr[report]'``).
"""

from __future__ import annotations

import html
import json
import math
import os
from dataclasses import asdict

import matplotlib

matplotlib.use("Agg")  # files only, whatever the environment says
import matplotlib.pyplot as plt
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator, PercentFormatter
from matplotlib.transforms import offset_copy

from dcr_core.text import plural
from flows.maintenance.audit import human_bytes
from flows.maintenance.report import RunReport
from storage.catalog import utc_epoch

FIGURES = ("bytes.png", "change_rate.png", "lag.png")
KEYFRAME_COLOR, DELTA_COLOR, SNAPSHOT_COLOR = "#d62728", "#1f77b4", "#ff9896"
# One colour per receiver (matplotlib's tab10, in order); lines are also drawn a little apart (points,
# not steps) so receivers at the same lag stay visible side by side.
RECEIVER_COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
                   "#bcbd22", "#17becf")
RECEIVER_SPREAD_PT = 2.0  # between neighbouring receivers' lines
MARKERS_UP_TO = 40  # points per line drawn with markers; longer lines are plain


def _step_axis(ax, r: RunReport) -> None:
    """Steps are whole numbers: integer ticks only, every committed step inside the axis."""
    steps = [p.step for p in r.steps] or [0]
    ax.set_xlim(min(steps) - 0.6, max(steps) + 0.6)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))
    ax.set_xlabel("step")


def bytes_figure(r: RunReport) -> Figure:
    """Stored bytes per step (keyframes red, deltas blue, a restart point's full snapshot stacked in
    pink) against the full checkpoint, on a log axis that starts a decade below the smallest bar."""
    fig, ax = plt.subplots(figsize=(9, 3.8), dpi=110)
    for kind, color, label in (("keyframe", KEYFRAME_COLOR, "keyframe (stored)"), ("delta", DELTA_COLOR, "delta (stored)")):
        points = [p for p in r.steps if p.kind == kind]
        if points:
            ax.bar([p.step for p in points], [max(p.bytes_stored, 1) for p in points], color=color, label=label)
    snaps = [p for p in r.steps if p.snapshot_bytes]
    if snaps:
        ax.bar([p.step for p in snaps], [p.snapshot_bytes for p in snaps], bottom=[max(p.bytes_stored, 1) for p in snaps],
               color=SNAPSHOT_COLOR, label="+ full snapshot (restart point)")
    ax.plot([p.step for p in r.steps], [p.bytes_full for p in r.steps], color="black", lw=1.2,
            marker="." if len(r.steps) <= MARKERS_UP_TO else None, label="full checkpoint")
    ax.set_yscale("log")
    values = [v for p in r.steps for v in (p.bytes_stored, p.bytes_full, p.bytes_stored + p.snapshot_bytes) if v > 0] or [1]
    ax.set_ylim(10 ** (math.floor(math.log10(min(values))) - 1), 10 ** (math.log10(max(values)) + 0.3))
    _step_axis(ax, r)
    ax.set_ylabel("bytes (log)")
    ax.set_title("Bytes stored per step vs the full checkpoint")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=4, fontsize=8, frameon=False)
    fig.tight_layout()
    return fig


def rate_figure(r: RunReport) -> Figure:
    """Each delta's share of changed elements, on an axis from 0 (small differences stay small)."""
    fig, ax = plt.subplots(figsize=(9, 3.4), dpi=110)
    deltas = [p for p in r.steps if p.change_rate is not None]
    rates = [100 * p.change_rate for p in deltas]
    ax.plot([p.step for p in deltas], rates, color=DELTA_COLOR, lw=1, label="delta",
            marker="o" if len(deltas) <= MARKERS_UP_TO else None, ms=3)
    for i, k in enumerate(r.keyframes):
        ax.axvline(k, color=KEYFRAME_COLOR, lw=0.8, ls="--", label=None if i else "keyframe")
    ax.set_ylim(0, 1.25 * max(rates) if rates and max(rates) > 0 else 1.0)
    ax.yaxis.set_major_formatter(PercentFormatter(xmax=100))
    _step_axis(ax, r)
    ax.set_ylabel("elements changed")
    ax.set_title("Change rate per delta")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2, fontsize=8, frameon=False)
    fig.tight_layout()
    return fig


def _time_unit(span_s: float) -> tuple[float, str]:
    return (3600.0, "hours") if span_s >= 3 * 3600 else (60.0, "minutes") if span_s >= 600 else (1.0, "seconds")


def lag_figure(r: RunReport) -> Figure:
    """Each receiver's lag (committed steps newer than the one it holds) over time: whole steps on
    the y axis, time since the first commit on the x axis; each receiver its own colour, its line
    shifted by a few points from the next so that receivers at the same lag do not hide each other."""
    fig, ax = plt.subplots(figsize=(9, 3.6), dpi=110)
    t0 = min((t for p in r.steps if (t := utc_epoch(p.committed_at)) is not None), default=0.0)
    lines = {rid: [(t - t0, p.lag) for p in points if (t := utc_epoch(p.at)) is not None] for rid, points in r.receivers.items()}
    lines = {rid: xy for rid, xy in lines.items() if xy}
    span = max((x for xy in lines.values() for x, _ in xy), default=0.0)
    scale, unit = _time_unit(span)
    n = len(lines)
    spread = RECEIVER_SPREAD_PT if n <= 5 else 8.0 / (n - 1)  # at most 8 pt between the outermost lines
    for i, (rid, xy) in enumerate(lines.items()):
        shift = offset_copy(ax.transData, fig=fig, y=(i - (n - 1) / 2) * spread, units="points")
        ax.step([x / scale for x, _ in xy], [lag for _, lag in xy], where="post", transform=shift, lw=1.6,
                color=RECEIVER_COLORS[i % len(RECEIVER_COLORS)], label=rid,
                marker="o" if len(xy) <= MARKERS_UP_TO else None, ms=3)
    top = max((lag for xy in lines.values() for _, lag in xy), default=1)
    pad = max(0.5, 0.06 * top)
    ax.set_ylim(-pad, max(top, 1) + pad)
    ax.yaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))
    ax.set_xlim(-0.02 * span / scale, (span / scale) * 1.02 if span > 0 else 1.0)
    ax.set_xlabel(f"{unit} since the first committed step")
    ax.set_ylabel("steps behind the latest")
    ax.set_title("Receivers' lag behind the latest committed step over time")
    if lines:
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    else:
        ax.text(0.5, 0.5, "no receiver has recorded a refit", transform=ax.transAxes, ha="center", color="#555")
    fig.tight_layout()
    return fig


def _save(fig: Figure, path: str) -> None:
    fig.savefig(path)
    plt.close(fig)


def _steps_text(steps: list[int]) -> str:
    """How many, then which: ``1 (step 0)``, ``3 (steps 0, 50, 100)``; a long list is cut in the middle."""
    if not steps:
        return "0"
    shown = [*map(str, steps[:8]), "\u2026", str(steps[-1])] if len(steps) > 10 else list(map(str, steps))
    return f"{len(steps)} ({plural(len(steps), 'step', count=False)} {', '.join(shown)})"


def _table(headers: list[str], rows: list[list], table_id: str) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in row) + "</tr>" for row in rows)
    return f'<table id="{table_id}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def render(r: RunReport, out_dir: str) -> str:
    """Write the page and its figures into ``out_dir``; the page's path."""
    os.makedirs(out_dir, exist_ok=True)
    _save(bytes_figure(r), os.path.join(out_dir, "bytes.png"))
    _save(rate_figure(r), os.path.join(out_dir, "change_rate.png"))
    _save(lag_figure(r), os.path.join(out_dir, "lag.png"))
    data = {**asdict(r), "latest": r.latest, "keyframes": r.keyframes, "restart_points": r.restart_points,
            "retracted": r.retracted}
    with open(os.path.join(out_dir, "report.json"), "w") as f:
        json.dump(data, f, indent=1)
    ratio = f"{100 * r.stored_total / r.full_total:.2f}%" if r.full_total else "-"  # a percent, as every figure of the page
    steps = [[p.step, p.kind + (" (retracted)" if p.retracted else ""), "-" if p.base_step is None else p.base_step,
              p.committed_at, human_bytes(p.bytes_stored),
              human_bytes(p.bytes_full), "-" if p.change_rate is None else f"{100 * p.change_rate:.3f}%",
              "yes" if p.restart_point else "", ] for p in r.steps]
    receivers = [[rid, r.positions.get(rid, "-"), "-" if r.lag_now(rid) is None else r.lag_now(rid),
                  max((p.lag for p in points), default="-")] for rid, points in r.receivers.items()]
    page = f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>DCR run report: {html.escape(r.root)}</title>
<style>
body {{ font: 14px/1.45 system-ui, sans-serif; margin: 2em auto; max-width: 1000px; color: #222; }}
table {{ border-collapse: collapse; margin: 1em 0; font-size: 13px; }}
th, td {{ border: 1px solid #ccc; padding: 3px 8px; text-align: right; }}
th {{ background: #f3f3f3; }} td:first-child, th:first-child {{ text-align: left; }}
figure {{ margin: 1.5em 0; }} figcaption {{ color: #555; }} img {{ max-width: 100%; }}
dl {{ display: grid; grid-template-columns: max-content auto; gap: 2px 16px; }} dt {{ font-weight: 600; }}
</style></head>
<body>
<h1>DCR run report</h1>
<dl id="summary">
<dt>ROOT</dt><dd>{html.escape(r.root)}</dd>
<dt>generated</dt><dd>{r.generated_at}</dd>
<dt>committed steps</dt><dd id="n-steps">{len(r.live)}</dd>
<dt>latest step</dt><dd id="latest">{'-' if r.latest is None else r.latest}</dd>
<dt>keyframes</dt><dd id="keyframes">{_steps_text(r.keyframes)}</dd>
<dt>restart points</dt><dd id="restart-points">{_steps_text(r.restart_points)}</dd>
<dt>stored / full</dt><dd id="ratio">{human_bytes(r.stored_total)} of {human_bytes(r.full_total)} ({ratio})</dd>
<dt>retracted steps</dt><dd id="retracted">{_steps_text(r.retracted)}</dd>
<dt>uncommitted attempts</dt><dd>{', '.join(map(str, r.uncommitted)) or '-'}</dd>
</dl>
<figure><img src="bytes.png" alt="bytes stored per step"><figcaption>Bytes stored per step against the
full checkpoint (log scale); keyframes in red, deltas in blue, full snapshots of restart points stacked in
pink.</figcaption></figure>
<figure><img src="change_rate.png" alt="change rate per step"><figcaption>Share of elements whose bits
changed, per delta (the axis starts at 0); dashed: keyframes.</figcaption></figure>
<figure><img src="lag.png" alt="receivers' lag over time"><figcaption>Each receiver's lag: committed steps
newer than the one it holds, rising with each commit and falling with each of its refits. Receivers at the
same lag are drawn a few points apart, each in its own colour.</figcaption></figure>
<h2>Steps</h2>
{_table(["step", "kind", "base", "committed at", "stored", "full", "change rate", "restart point"], steps, "steps")}
<h2>Receivers</h2>
{_table(["receiver", "step now", "lag now", "largest lag seen"], receivers, "receivers") if receivers else
 "<p id='receivers'>No receiver has recorded a commit.</p>"}
<script>
window.addEventListener("load", () => {{
  const ok = [...document.images].filter(i => i.complete && i.naturalWidth > 0).length;
  document.body.dataset.imagesLoaded = String(ok);
}});
</script>
</body></html>
"""
    path = os.path.join(out_dir, "index.html")
    with open(path, "w") as f:
        f.write(page)
    return path
