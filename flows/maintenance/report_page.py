"""``dcr report ROOT --out DIR``: a run as a static page, ``DIR/index.html`` with three figures
(``bytes.png``, ``change_rate.png``, ``lag.png``) and ``report.json`` (the data behind them).

The page needs nothing but a browser: no script from elsewhere, images beside it, every number also
in a table. matplotlib draws the figures (the ``report`` extra: ``pip install 'dcr[report]'``).
"""

from __future__ import annotations

import html
import json
import os
from dataclasses import asdict

import matplotlib

matplotlib.use("Agg")  # files only, whatever the environment says
import matplotlib.pyplot as plt

from flows.maintenance.audit import human_bytes
from flows.maintenance.report import RunReport, epoch

FIGURES = ("bytes.png", "change_rate.png", "lag.png")


def _bytes_figure(r: RunReport, path: str) -> None:
    fig, ax = plt.subplots(figsize=(9, 3.6), dpi=110)
    steps = [p.step for p in r.steps]
    colors = ["#d62728" if p.kind == "keyframe" else "#1f77b4" for p in r.steps]
    ax.bar(steps, [max(p.bytes_stored, 1) for p in r.steps], color=colors, label="stored (delta or keyframe)")
    snaps = [p for p in r.steps if p.snapshot_bytes]
    if snaps:
        ax.bar([p.step for p in snaps], [p.snapshot_bytes for p in snaps], bottom=[max(p.bytes_stored, 1) for p in snaps],
               color="#ff9896", label="+ full snapshot (restart point)")
    ax.plot(steps, [p.bytes_full for p in r.steps], color="black", lw=1.2, marker=".", label="full checkpoint")
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("bytes")
    ax.set_title("Bytes stored per step vs the full checkpoint (keyframes red)")
    ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _rate_figure(r: RunReport, path: str) -> None:
    fig, ax = plt.subplots(figsize=(9, 3.2), dpi=110)
    deltas = [p for p in r.steps if p.change_rate is not None]
    ax.plot([p.step for p in deltas], [100 * p.change_rate for p in deltas], marker="o", ms=3, lw=1)
    for k in r.keyframes:
        ax.axvline(k, color="#d62728", lw=0.8, ls="--")
    ax.set_xlabel("step")
    ax.set_ylabel("elements changed (%)")
    ax.set_title("Change rate per delta (dashed: keyframes)")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _lag_figure(r: RunReport, path: str) -> None:
    fig, ax = plt.subplots(figsize=(9, 3.2), dpi=110)
    t0 = min((epoch(p.committed_at) or 0 for p in r.steps), default=0)
    for rid, points in r.receivers.items():
        xs = [(epoch(p.at) or t0) - t0 for p in points]
        ax.step(xs, [p.lag for p in points], where="post", marker="o", ms=3, label=rid)
    ax.set_xlabel("seconds since the first committed step")
    ax.set_ylabel("steps behind the latest")
    ax.set_title("Receivers' lag behind the latest committed step over time")
    if r.receivers:
        ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _table(headers: list[str], rows: list[list], table_id: str) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in row) + "</tr>" for row in rows)
    return f'<table id="{table_id}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def render(r: RunReport, out_dir: str) -> str:
    """Write the page and its figures into ``out_dir``; the page's path."""
    os.makedirs(out_dir, exist_ok=True)
    _bytes_figure(r, os.path.join(out_dir, "bytes.png"))
    _rate_figure(r, os.path.join(out_dir, "change_rate.png"))
    _lag_figure(r, os.path.join(out_dir, "lag.png"))
    data = {**asdict(r), "latest": r.latest, "keyframes": r.keyframes, "restart_points": r.restart_points}
    with open(os.path.join(out_dir, "report.json"), "w") as f:
        json.dump(data, f, indent=1)
    ratio = f"{r.stored_total / r.full_total:.4f}" if r.full_total else "-"
    steps = [[p.step, p.kind, "-" if p.base_step is None else p.base_step, p.committed_at, human_bytes(p.bytes_stored),
              human_bytes(p.bytes_full), "-" if p.change_rate is None else f"{100 * p.change_rate:.3f}%",
              "yes" if p.restart_point else "", ] for p in r.steps]
    latest = r.latest
    receivers = [[rid, r.positions.get(rid, "-"),
                  "-" if latest is None or rid not in r.positions else sum(1 for p in r.steps if p.step > r.positions[rid]),
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
<dt>committed steps</dt><dd id="n-steps">{len(r.steps)}</dd>
<dt>latest step</dt><dd id="latest">{'-' if r.latest is None else r.latest}</dd>
<dt>keyframes</dt><dd id="keyframes">{', '.join(map(str, r.keyframes)) or '-'}</dd>
<dt>restart points</dt><dd id="restart-points">{', '.join(map(str, r.restart_points)) or '-'}</dd>
<dt>stored / full</dt><dd id="ratio">{human_bytes(r.stored_total)} of {human_bytes(r.full_total)} ({ratio})</dd>
<dt>uncommitted attempts</dt><dd>{', '.join(map(str, r.uncommitted)) or '-'}</dd>
</dl>
<figure><img src="bytes.png" alt="bytes stored per step"><figcaption>Bytes stored per step against the
full checkpoint (log scale); keyframes in red, full snapshots of restart points stacked in pink.</figcaption></figure>
<figure><img src="change_rate.png" alt="change rate per step"><figcaption>Share of elements whose bits
changed, per delta.</figcaption></figure>
<figure><img src="lag.png" alt="receivers' lag over time"><figcaption>Each receiver's lag: committed steps
newer than the one it holds, rising with each commit and falling with each of its refits.</figcaption></figure>
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
