"""``dcr report``: the page a user opens, loaded in headless Chromium (Debian's ``chromium``;
``.ci/run`` installs it). The test checks what the browser shows, not the HTML source: every
figure loaded, the summary's numbers, one table row per step and per receiver, and a screenshot
that is not blank."""

from __future__ import annotations

import html.parser
import os
import shutil
import subprocess

import matplotlib.image
import pytest
import torch

from dcr_core.retention import KeyframePolicy
from flows import run_publish
from flows.options import PublishOptions
from flows.receive.pipeline import run_receive
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


def test_report_page_shows_the_run_in_a_browser(chromium, tmp_path):
    root, g = str(tmp_path / "bucket"), torch.Generator().manual_seed(0)
    ck = {"w": torch.randn(256, 128, generator=g).bfloat16(), "b": torch.randn(128, generator=g)}
    opts = PublishOptions(keyframe_policy=KeyframePolicy(every=4))
    for step in range(9):
        if step:
            flat = ck["w"].view(-1).view(torch.int16)
            flat[torch.randperm(flat.numel(), generator=g)[: 100 + 50 * step]] ^= 1
        run_publish(root, {k: v.clone() for k, v in ck.items()}, step, options=opts)
        if step % 2 == 0:
            run_receive(root, "rollout-0", str(tmp_path / "r0.safetensors"))
        if step == 3:
            run_receive(root, "rollout-1", str(tmp_path / "r1.safetensors"))
    out_dir = tmp_path / "report"
    out = dcr("report", root, "--out", out_dir, check=0)
    assert out.stdout.startswith(f"wrote {out_dir / 'index.html'} (9 steps, 2 receivers")

    base = FLAGS + [f"--user-data-dir={tmp_path / 'chromium'}"]
    page = (out_dir / "index.html").as_uri()
    dumped = subprocess.run([chromium, *base, "--dump-dom", page], capture_output=True, text=True, timeout=120)
    assert dumped.returncode == 0, dumped.stderr[-2000:]
    dom = _Dom()
    dom.feed(dumped.stdout)
    assert dom.body.get("data-images-loaded") == "3", dom.body  # the page's script counted the loaded figures
    assert dom.text["n-steps"] == "9" and dom.text["latest"] == "8"
    assert dom.text["keyframes"] == "0" and dom.text["restart-points"] == "0, 4, 8"
    steps = dom.rows["steps"]
    assert [r[0] for r in steps] == [str(s) for s in range(9)]
    assert [r[1] for r in steps] == ["keyframe"] + ["delta"] * 8
    assert [r[-1] for r in steps] == ["yes", "", "", "", "yes", "", "", "", "yes"]
    receivers = {r[0]: r for r in dom.rows["receivers"]}
    assert receivers["rollout-0"][1:3] == ["8", "0"] and receivers["rollout-1"][1:3] == ["3", "5"], receivers

    shot = tmp_path / "shot.png"
    taken = subprocess.run([chromium, *base, "--window-size=1100,1800", f"--screenshot={shot}", page],
                           capture_output=True, text=True, timeout=120)
    assert taken.returncode == 0 and shot.exists(), taken.stderr[-2000:]
    pixels = matplotlib.image.imread(str(shot))
    assert pixels.shape[:2] == (1800, 1100) and pixels[..., :3].std() > 0.05  # drawn, not a blank page
