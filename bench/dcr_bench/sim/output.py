"""What ``dcr simulate`` prints and writes: the table, ``simulation.json`` and ``simulation.png``."""

from __future__ import annotations

import json
import os
import sys

from dcr_bench.sim.model import Model, Timeline
from dcr_bench.sim.scenario import Scenario, to_dict
from dcr_core.text import plural

# One colour per phase: the full checkpoint's upload and download are not DCR's encode+upload and
# fetch+decode (lighter shades of the same hues).
COLORS = {"prepare": "#bbbbbb", "encode+upload": "#1f77b4", "commit": "#444444", "copy": "#ff7f0e",
          "wait for commit": "#eeeeee", "fetch+decode": "#2ca02c", "verify+install": "#9467bd",
          "upload": "#9ecae1", "download": "#a1d99b"}
ACTORS = ("publisher", "mirror", "receiver")


def fmt_s(x: float) -> str:
    if x >= 3600:
        return f"{x / 3600:.2f} h"
    if x >= 120:
        return f"{x / 60:.1f} min"
    return f"{x:.2f} s"


def fmt_bytes(x: float) -> str:
    """Decimal units, three significant digits, never an exponent: ``2 TB``, ``60 GB``, ``9.4 MB``."""
    for unit, n in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if x >= n:
            return f"{x / n:.3g} {unit}"
    return f"{x:.3g} B"


def fmt_count(x: float) -> str:
    """A parameter count: ``1T``, ``247B``, ``100M``, ``50k``."""
    for unit, n in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if x >= n:
            return f"{x / n:.3g}{unit}"
    return f"{x:.3g}"


def label(t: Timeline) -> str:
    return t.mode if t.mode == "full" else f"{t.mode}, {'streaming' if t.streaming else 'sequential'}"


def rows(timelines: list[Timeline]) -> list[dict]:
    full = next((t.total_s for t in timelines if t.mode == "full"), None)
    return [{"mode": t.mode, "streaming": t.streaming, "total_s": t.total_s,
             "speedup_vs_full": full / t.total_s if full else None,
             "ratio_to_full": t.total_s / full if full else None} for t in timelines]


def table(sc: Scenario, timelines: list[Timeline]) -> str:
    m = Model(sc).size
    head = (f"{sc.name}: {fmt_count(sc.model.parameters)} params x {sc.model.bytes_per_param} B = {fmt_bytes(m.raw)}, "
            f"{100 * sc.model.change_rate:g}% changed x {sc.model.bytes_per_change:g} B = delta {fmt_bytes(m.delta)} "
            f"in {m.objects:.0f} chunks of {plural(sc.model.tensors, 'tensor')}, {sc.model.layout} layout: "
            f"{m.puts:.0f} PUTs, {m.gets:.0f} GETs per receive; {plural(sc.topology.regions, 'region')} x "
            f"{plural(sc.topology.receivers_per_region, 'receiver')}")
    lines = [head, f"  {'mode':<8} {'streaming':<10} {'total':>10} {'seconds':>10} {'ratio to full':>14} {'x faster':>9}"]
    for r in rows(timelines):
        ratio = "" if r["ratio_to_full"] is None else f"{r['ratio_to_full']:.4f}"
        faster = "" if r["speedup_vs_full"] is None else f"{r['speedup_vs_full']:.1f}"
        lines.append(f"  {r['mode']:<8} {('-' if r['mode'] == 'full' else 'yes' if r['streaming'] else 'no'):<10} "
                     f"{fmt_s(r['total_s']):>10} {r['total_s']:>10.2f} {ratio:>14} {faster:>9}")
    return "\n".join(lines)


def document(sc: Scenario, source: str, timelines: list[Timeline]) -> dict:
    m = Model(sc).size
    return {"scenario": sc.name, "file": source, "description": sc.description, "inputs": to_dict(sc),
            "derived": {"raw_bytes": m.raw, "delta_bytes": m.delta, "delta_objects": m.objects,
                        "object_bytes": m.object_bytes, "full_parts": m.full_parts,
                        "changed_tensors": m.changed_tensors, "packs": m.packs, "puts": m.puts, "gets": m.gets},
            "summary": rows(timelines), "timelines": [t.to_dict() for t in timelines]}


def write(sc: Scenario, source: str, timelines: list[Timeline], out: str) -> list[str]:
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, "simulation.json")
    with open(path, "w") as f:
        json.dump(document(sc, source, timelines), f, indent=2)
        f.write("\n")
    written = [path]
    try:
        written.append(plot(sc, timelines, os.path.join(out, "simulation.png")))
    except ImportError as e:
        print(f"dcr simulate: plot skipped: matplotlib is not importable ({e})", file=sys.stderr)
    return written


def plot(sc: Scenario, timelines: list[Timeline], path: str) -> str:
    """Write ``figure``'s chart to ``path``."""
    import matplotlib.pyplot as plt

    fig = figure(sc, timelines)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def figure(sc: Scenario, timelines: list[Timeline]):
    """One Gantt chart per (mode, streaming), all on one time axis (the bars' lengths compare across
    charts), and the totals as bars on a log axis with a labelled tick at 1, 2 and 5 of each decade."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    n = len(timelines)
    fig = plt.figure(figsize=(13, 1.6 * n + 1.6))
    grid = fig.add_gridspec(n, 2, width_ratios=(2.2, 1))
    seen: dict[str, object] = {}
    longest = max(t.total_s for t in timelines)
    first = None
    for i, t in enumerate(timelines):
        ax = fig.add_subplot(grid[i, 0], sharex=first)
        first = first or ax
        actors = [a for a in ACTORS if any(s.actor == a for s in t.segments)]
        for s in t.segments:
            if s.end <= s.start:
                continue
            y = actors.index(s.actor)
            bar = ax.barh(y, s.end - s.start, left=s.start, color=COLORS.get(s.phase, "#17becf"),
                          edgecolor="black", linewidth=0.4, height=0.6)
            seen.setdefault(s.phase, bar)
        ax.set_yticks(range(len(actors)), actors, fontsize=8)
        ax.invert_yaxis()
        ax.set_title(f"{label(t)}: {fmt_s(t.total_s)}", fontsize=9, loc="left")
        ax.tick_params(axis="x", labelsize=8, labelbottom=i == n - 1)
        ax.grid(True, axis="x", alpha=0.3)
    first.set_xlim(0, longest * 1.02)
    ax.set_xlabel("seconds since the publish started (one scale for every chart)")
    bx = fig.add_subplot(grid[:, 1])
    labels = [label(t) for t in timelines]
    totals = [t.total_s for t in timelines]
    bx.barh(range(n), totals, color=["#d62728" if t.mode == "full" else "#2ca02c" for t in timelines])
    bx.set_yticks(range(n), labels, fontsize=8)
    bx.invert_yaxis()
    bx.set_xscale("log")
    lo, hi = min(totals) / 2, max(totals) * 4  # room on the right for each bar's label
    bx.set_xlim(lo, hi)
    # labelled ticks at 1, 2 and 5 of each decade (one decade alone would leave a single label)
    bx.xaxis.set_major_locator(matplotlib.ticker.LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    bx.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda x, _: f"{x:g}"))
    bx.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    bx.tick_params(axis="x", labelsize=8)
    bx.set_xlabel("refit time (s, log)")
    for y, t in enumerate(timelines):
        bx.text(t.total_s, y, f" {fmt_s(t.total_s)}", va="center", fontsize=8)
    bx.grid(True, axis="x", which="both", alpha=0.3)
    fig.legend(list(seen.values()), list(seen), loc="lower center", ncol=min(8, len(seen)), fontsize=8)
    fig.suptitle(f"dcr simulate: {sc.name}", fontsize=11)
    fig.tight_layout(rect=(0, 0.05, 1, 0.97))
    return fig
