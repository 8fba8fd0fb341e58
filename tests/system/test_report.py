"""``dcr report``: the page a user opens, loaded in headless Chromium (Debian's ``chromium``;
``.ci/run`` installs it), for a short run (3 steps, published and received for real) and a long one
(200 steps, 4 receivers, written as the publisher and the receivers write their records). The tests
check what a reader sees: in the browser, every figure loaded, the summary's counts, one table row
per step and per receiver, a screenshot showing the figures' colours; in the figures (the same
functions the page uses), integer step and lag ticks, axis ranges that show what was stored, the
legend's entries in the bars' own colours, and every receiver's line visible in the PNG."""

from __future__ import annotations

import html.parser
import json
import math
import os
import re
import shutil
import subprocess

import matplotlib.colors
import matplotlib.image
import numpy as np
import pytest
import torch

from dcr_core.chain import DELTA, KEYFRAME
from dcr_core.retention import KeyframePolicy
from flows import run_publish
from flows.maintenance.inspect import format_history, receiver_history
from flows.maintenance.report import build_report
from flows.maintenance.report_page import (
    DELTA_COLOR,
    KEYFRAME_COLOR,
    RECEIVER_COLORS,
    SNAPSHOT_COLOR,
    bytes_figure,
    lag_figure,
    rate_figure,
)
from flows.options import PublishOptions
from flows.receive.pipeline import run_receive
from storage import layout
from storage.catalog import Catalog, utc_now
from storage.marker import CommitMarker
from storage.root import open_root
from tests.support.cli import dcr

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]


@pytest.fixture
def chromium():
    if CHROMIUM is None:
        if os.environ.get("DCR_NO_CHROMIUM"):
            pytest.skip(f"chromium could not be installed: {os.environ['DCR_NO_CHROMIUM']}")
        if os.environ.get("CI"):
            pytest.fail("chromium is not installed; .ci/run installs Debian's chromium package")
        pytest.skip("needs chromium (Debian package chromium)")
    return CHROMIUM


class _Dom(html.parser.HTMLParser):
    """The ids' texts, the body's attributes and each table's rows of a dumped DOM."""

    def __init__(self):
        super().__init__()
        self.text: dict[str, str] = {}
        self.body: dict[str, str] = {}
        self.rows: dict[str, list[list[str]]] = {}
        self._id = self._table = None
        self._row: list[str] | None = None
        self._cell: list[str] | None = None

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "body":
            self.body = a
        if tag == "table":
            self._table = a.get("id")
            self.rows[self._table] = []
        elif tag == "tr" and self._table:
            self._row = []
        elif tag == "td" and self._row is not None:
            self._cell = []
        if "id" in a and tag != "table":
            self._id = a["id"]
            self.text[self._id] = ""

    def handle_endtag(self, tag):
        if tag == "td" and self._cell is not None:
            self._row.append("".join(self._cell).strip())
            self._cell = None
        elif tag == "tr" and self._row:
            self.rows[self._table].append(self._row)
            self._row = None
        elif tag == "table":
            self._table = None
        elif tag in ("dd", "p"):
            self._id = None

    def handle_data(self, data):
        if self._cell is not None:
            self._cell.append(data)
        if self._id is not None:
            self.text[self._id] += data


# ---------------------------------------------------------------- the two runs


def short_run(tmp_path) -> str:
    """3 steps published and received in this process: step 0 a keyframe, step 2 a delta that is
    also a restart point; rollout-0 follows every step, rollout-1 stops at step 1 (lag 1)."""
    root, g = str(tmp_path / "bucket"), torch.Generator().manual_seed(0)
    ck = {"w": torch.randn(64, 32, generator=g).bfloat16(), "b": torch.randn(32, generator=g)}
    opts = PublishOptions(keyframe_policy=KeyframePolicy(every=2))
    for step in range(3):
        if step:
            flat = ck["w"].view(-1).view(torch.int16)
            flat[torch.randperm(flat.numel(), generator=g)[: 40 + 10 * step]] ^= 1
        run_publish(root, {k: v.clone() for k, v in ck.items()}, step, options=opts)
        run_receive(root, "rollout-0", str(tmp_path / "r0.safetensors"))
        if step < 2:
            run_receive(root, "rollout-1", str(tmp_path / "r1.safetensors"))
    return root


LONG_STEPS, T0 = 200, 1_767_225_600.0  # 2026-01-01T00:00:00Z
# receiver: (the steps it refits at, seconds after the commit it follows)
LONG_RECEIVERS = {
    "rollout-a": (range(0, 200), 0.05),  # every step, right away
    "rollout-b": (range(0, 200), 0.06),  # the same steps: its line lies on rollout-a's
    "rollout-c": (range(0, 200, 10), 0.02),  # every 10th step
    "rollout-d": (range(0, 161, 40), 0.09),  # every 40th, then stops at step 160: 39 behind
}


def long_run(tmp_path) -> str:
    """200 steps a quarter of a second apart with 4 receivers at different lags, written the way
    the publisher (its commit markers) and the receivers (their records and positions) write them,
    in well under a second: keyframes every 50 steps, restart points (a delta with a full snapshot)
    between them, change rates between 2.888% and 2.894%."""
    root = open_root(str(tmp_path / "bucket"))
    full = 1 << 20
    digest = "ab" * 32
    for step in range(LONG_STEPS):
        kind = KEYFRAME if step % 50 == 0 else DELTA
        rate = 0.02888 + 0.00006 * ((7 * step) % 11) / 10
        summary = {"tensors": 4, "tensors_changed": 4, "bytes_full": full,
                   "bytes_stored": full if kind == KEYFRAME else int(full * rate * 1.2)}
        if kind == DELTA:
            summary["change_rate"] = rate
        if step % 50 == 25:
            summary["snapshot_bytes"] = full
        marker = CommitMarker(step, f"{step:016x}", digest, kind, None if kind == KEYFRAME else step - 1, digest,
                              utc_now(T0 + 0.25 * step), summary)
        root.write(layout.commit_key(step), marker.to_json())
    cat = Catalog(root)
    events = sorted((T0 + 0.25 * step + delay, rid, step)
                    for rid, (steps, delay) in LONG_RECEIVERS.items() for step in steps)
    held: dict[str, int] = {}
    for at, rid, step in events:
        cat.record_receiver(step, rid, {"committed_at": utc_now(at), "from_step": held.get(rid),
                                        "moves": [f"forward:{step}"], "bytes_pulled": 1000, "policy_digest": digest})
        held[rid] = step
    return root.url


# ---------------------------------------------------------------- what a reader sees


def look(chromium, tmp_path, root) -> tuple[_Dom, np.ndarray, str]:
    """``dcr report`` of ``root``, then the page in headless Chromium: its DOM after load, and a
    screenshot of the top of the page (the summary and the three figures)."""
    out_dir = tmp_path / "report"
    out = dcr("report", root, "--out", out_dir, check=0)
    assert out.stdout.startswith(f"wrote {out_dir / 'index.html'}"), out.stdout
    base = FLAGS + [f"--user-data-dir={tmp_path / 'chromium'}"]
    page = (out_dir / "index.html").as_uri()
    dumped = subprocess.run([chromium, *base, "--dump-dom", page], capture_output=True, text=True, timeout=120)
    assert dumped.returncode == 0, dumped.stderr[-2000:]
    dom = _Dom()
    dom.feed(dumped.stdout)
    assert dom.body.get("data-images-loaded") == "3", dom.body  # the page's script counted the loaded figures
    shot = tmp_path / "shot.png"
    taken = subprocess.run([chromium, *base, "--window-size=1100,1900", f"--screenshot={shot}", page],
                           capture_output=True, text=True, timeout=120)
    assert taken.returncode == 0 and shot.exists(), taken.stderr[-2000:]
    pixels = matplotlib.image.imread(str(shot))[..., :3]
    assert pixels.shape[:2] == (1900, 1100) and pixels.std() > 0.05  # drawn, not a blank page
    for color in (KEYFRAME_COLOR, DELTA_COLOR):  # the figures are on the screen: their bars' colours are
        assert _pixels_of(pixels, color) > 200, color
    return dom, pixels, str(out_dir)


def _pixels_of(pixels: np.ndarray, color: str, tolerance: float = 0.06) -> int:
    rgb = np.array(matplotlib.colors.to_rgb(color))
    return int((np.abs(pixels[..., :3] - rgb).max(axis=-1) < tolerance).sum())


def _visible_ticks(ax, axis: str) -> list[str]:
    ax.figure.canvas.draw()
    a = ax.xaxis if axis == "x" else ax.yaxis
    lo, hi = sorted(ax.get_xlim() if axis == "x" else ax.get_ylim())
    return [t.get_text() for t in a.get_ticklabels() if lo <= t.get_position()[0 if axis == "x" else 1] <= hi]


def check_figures(root: str, out_dir: str, lag_now: dict[str, int]) -> None:
    """The figures the page shows, drawn again by the same functions from the same data."""
    r = build_report(open_root(root))
    steps = [p.step for p in r.steps]

    fig = bytes_figure(r)
    ax = fig.axes[0]
    ticks = _visible_ticks(ax, "x")
    assert ticks and all(re.fullmatch(r"\d+", t) for t in ticks), ticks  # whole steps: no -0.5, 0.5
    assert int(ticks[0]) >= steps[0] and int(ticks[-1]) <= steps[-1]
    assert ax.get_xlim()[0] < steps[0] and ax.get_xlim()[1] > steps[-1]
    bottom, top = ax.get_ylim()
    smallest = min(p.bytes_stored for p in r.steps)
    # the smallest bar spans at least a quarter of the log axis (not a sliver), the full line is inside
    assert math.log10(smallest / bottom) >= 0.25 * math.log10(top / bottom), (bottom, top, smallest)
    assert top > max(p.bytes_full for p in r.steps)
    legend = {t.get_text(): h for t, h in zip(ax.get_legend().get_texts(), ax.get_legend().legend_handles)}
    assert {"keyframe (stored)", "delta (stored)", "full checkpoint"} <= set(legend), legend
    bars = {round(b.get_x() + b.get_width() / 2): b.get_facecolor() for b in ax.patches if b.get_y() <= 1}
    for label, color, step in (("keyframe (stored)", KEYFRAME_COLOR, r.keyframes[0]),
                               ("delta (stored)", DELTA_COLOR, next(p.step for p in r.steps if p.kind == DELTA))):
        assert matplotlib.colors.same_color(legend[label].get_facecolor(), color)
        assert matplotlib.colors.same_color(bars[step], color), (label, step)
    if any(p.snapshot_bytes for p in r.steps):
        assert matplotlib.colors.same_color(legend["+ full snapshot (restart point)"].get_facecolor(), SNAPSHOT_COLOR)

    fig = rate_figure(r)
    ax = fig.axes[0]
    rates = [100 * p.change_rate for p in r.steps if p.change_rate is not None]
    assert ax.get_ylim()[0] == 0 and max(rates) < ax.get_ylim()[1] <= 1.5 * max(rates)  # from 0: no zoom into noise
    assert all(re.fullmatch(r"\d+", t) for t in _visible_ticks(ax, "x"))
    assert {t.get_text() for t in ax.get_legend().get_texts()} == {"delta", "keyframe"}

    fig = lag_figure(r)
    ax = fig.axes[0]
    lines = {ln.get_label(): ln for ln in ax.get_lines()}
    assert set(lines) == set(lag_now)
    assert len({matplotlib.colors.to_hex(ln.get_color()) for ln in lines.values()}) == len(lines)  # one colour each
    ticks = _visible_ticks(ax, "y")
    assert ticks and all(re.fullmatch(r"\d+", t) for t in ticks), ticks  # whole steps behind
    for rid, ln in lines.items():
        assert ln.get_ydata()[-1] == lag_now[rid], rid  # each line ends at the lag the table gives
        assert len(set(ln.get_xdata())) > 1 and ln.get_xdata()[-1] > 0  # sub-second stamps: spread in time
    # the same point (t, lag) is drawn at a different height for each receiver: none hides another
    heights = {round(float(ln.get_transform().transform((1.0, 1.0))[1]), 1) for ln in lines.values()}
    assert len(heights) == len(lines)
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend == list(lag_now)
    lag_png = matplotlib.image.imread(os.path.join(out_dir, "lag.png"))[..., :3]
    for i, rid in enumerate(lag_now):  # every receiver's colour is on the PNG the page shows
        assert _pixels_of(lag_png, RECEIVER_COLORS[i]) > 150, rid


# ---------------------------------------------------------------- the tests


def test_report_of_a_short_run_reads_right_in_a_browser(chromium, tmp_path):
    root = short_run(tmp_path)
    dom, _, out_dir = look(chromium, tmp_path, root)
    assert dom.text["n-steps"] == "3" and dom.text["latest"] == "2"
    assert dom.text["keyframes"] == "1 (step 0)"  # a count, then which steps
    assert dom.text["restart-points"] == "2 (steps 0, 2)"
    steps = dom.rows["steps"]
    assert [r[0] for r in steps] == ["0", "1", "2"] and [r[1] for r in steps] == ["keyframe", "delta", "delta"]
    assert [r[-1] for r in steps] == ["yes", "", "yes"]
    receivers = {r[0]: r for r in dom.rows["receivers"]}
    assert receivers["rollout-0"][1:3] == ["2", "0"] and receivers["rollout-1"][1:3] == ["1", "1"], receivers
    check_figures(root, out_dir, {"rollout-0": 0, "rollout-1": 1})
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    assert report["keyframes"] == [0] and report["restart_points"] == [0, 2]
    stored = sum(p["bytes_stored"] + p["snapshot_bytes"] for p in report["steps"])
    full = sum(p["bytes_full"] for p in report["steps"])  # a percent, as the change rates of the table below
    assert dom.text["ratio"].endswith(f" ({100 * stored / full:.2f}%)"), dom.text["ratio"]


def test_report_of_a_long_run_reads_right_in_a_browser(chromium, tmp_path):
    root = long_run(tmp_path)
    dom, _, out_dir = look(chromium, tmp_path, root)
    assert dom.text["n-steps"] == "200" and dom.text["latest"] == "199"
    assert dom.text["keyframes"] == "4 (steps 0, 50, 100, 150)"
    assert dom.text["restart-points"] == "8 (steps 0, 25, 50, 75, 100, 125, 150, 175)"
    assert [r[0] for r in dom.rows["steps"]] == [str(s) for s in range(200)]
    receivers = {r[0]: r[1:3] for r in dom.rows["receivers"]}
    lag_now = {"rollout-a": 0, "rollout-b": 0, "rollout-c": 9, "rollout-d": 39}
    assert receivers == {"rollout-a": ["199", "0"], "rollout-b": ["199", "0"], "rollout-c": ["190", "9"],
                         "rollout-d": ["160", "39"]}, receivers
    check_figures(root, out_dir, lag_now)
    r = build_report(open_root(root))
    c = [(p.step, p.lag) for p in r.receivers["rollout-c"]]
    assert c[:3] == [(0, 0), (0, 1), (0, 2)] and max(lag for _, lag in c) == 10  # +1 per commit, 0 at its refit


def test_status_keeps_the_history_of_a_receiver_back_at_a_step_it_held(tmp_path):
    """``dcr status ROOT --receiver ID``: a receiver that goes 0 -> 2 -> 0 -> 2 keeps all four refits."""
    root, g = str(tmp_path / "bucket"), torch.Generator().manual_seed(1)
    ck = {"w": torch.randn(32, 32, generator=g).bfloat16()}
    for step in range(3):
        if step:
            ck["w"].view(-1).view(torch.int16)[torch.randperm(1024, generator=g)[:30]] ^= 1
        run_publish(root, {k: v.clone() for k, v in ck.items()}, step)
    state = str(tmp_path / "r.safetensors")
    for step in (0, 2, 0, 2):
        run_receive(root, "r", state, step)
    records = receiver_history(open_root(root), "r")
    assert [(r.get("from_step"), r["step"]) for r in records] == [(None, 0), (0, 2), (2, 0), (0, 2)]
    assert all("earlier" not in r for r in records)
    out = dcr("status", root, "--receiver", "r", check=0).stdout
    assert out.splitlines()[0].startswith("receiver r: 4 refits recorded") and out == format_history("r", records) + "\n"
    recs = json.loads(dcr("status", root, "--receiver", "r", "--json", check=0).stdout)
    assert [(r["from_step"], r["step"]) for r in recs] == [(None, 0), (0, 2), (2, 0), (0, 2)]
    r = build_report(open_root(root))  # the lag chart sees every visit too
    assert [(p.step, p.lag) for p in r.receivers["r"]] == [(0, 2), (2, 0), (0, 2), (2, 0)]


def test_a_one_step_run_still_gets_whole_step_ticks(tmp_path):
    root = str(tmp_path / "bucket")
    run_publish(root, {"w": torch.ones(64)}, 0)
    r = build_report(open_root(root))
    assert _visible_ticks(bytes_figure(r).axes[0], "x") == ["0"] == _visible_ticks(rate_figure(r).axes[0], "x")
    ax = lag_figure(r).axes[0]  # no receiver yet: said, not an empty frame
    assert [t.get_text() for t in ax.texts] == ["no receiver has recorded a refit"]


def test_a_retracted_step_is_marked_and_counts_in_no_lag_as_in_status(tmp_path):
    """Steps 0..2 published, both receivers at step 2, then step 2 retracted and one receiver moved
    back to step 1: ``report.json`` marks step 2 retracted, its latest step is 1, and each receiver's
    lag now (and at the end of its timeline) is what ``dcr status`` says: 0 for both (a retracted step
    is newer than nothing a receiver should reach)."""
    from flows import run_retract

    root, g = str(tmp_path / "bucket"), torch.Generator().manual_seed(2)
    ck = {"w": torch.randn(32, 32, generator=g).bfloat16()}
    for step in range(3):
        if step:
            ck["w"].view(-1).view(torch.int16)[torch.randperm(1024, generator=g)[:30]] ^= 1
        run_publish(root, {k: v.clone() for k, v in ck.items()}, step)
        run_receive(root, "a", str(tmp_path / "a.safetensors"))
    run_receive(root, "b", str(tmp_path / "b.safetensors"))
    run_retract(root, 2, reason="bad")
    assert run_receive(root, "a", str(tmp_path / "a.safetensors")).step == 1

    dcr("report", root, "--out", tmp_path / "report", check=0)
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    assert report["latest"] == 1 and report["retracted"] == [2]
    assert [(s["step"], s["retracted"]) for s in report["steps"]] == [(0, False), (1, False), (2, True)]
    assert report["steps"][2]["retracted_at"]
    status = json.loads(dcr("status", root, "--json", check=0).stdout)
    assert status["latest"] == 1 and {r["receiver"]: r["lag"] for r in status["receivers"]} == {"a": 0, "b": 0}
    r = build_report(open_root(root))
    assert {rid: r.lag_now(rid) for rid in ("a", "b")} == {"a": 0, "b": 0}
    assert {rid: points[-1]["lag"] for rid, points in report["receivers"].items()} == {"a": 0, "b": 0}, report["receivers"]
    html_page = (tmp_path / "report" / "index.html").read_text()
    assert '<dd id="n-steps">2</dd>' in html_page and '<dd id="retracted">1 (step 2)</dd>' in html_page
