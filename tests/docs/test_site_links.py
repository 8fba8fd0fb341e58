"""The built site navigates from the disk: every link of its pages names a file, none a directory
(a browser shows a directory listing for those over ``file://``). ``make docs`` fails otherwise
(the check runs in the site's hook, ``tools/docs/hooks.py``); here the check itself."""

from __future__ import annotations

import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

_spec = importlib.util.spec_from_file_location("site_links", REPO / "tools" / "docs" / "site_links.py")
site_links = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(site_links)


def _page(path: Path, body: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"<html><body>{body}</body></html>")


def test_links_to_a_directory_or_a_missing_file_are_named_and_the_rest_pass(tmp_path):
    (tmp_path / "assets").mkdir()
    (tmp_path / "assets" / "x.css").write_text("")
    _page(tmp_path / "guides" / "receivers.html", "<a href='../index.html#top'>home</a> <link href='assets/x.css'>")
    _page(tmp_path / "guides" / "index.html", "")
    _page(tmp_path / "index.html", "<link href='assets/x.css' rel='stylesheet'>"
          "<a href='guides/'>a directory</a> <a href='guides/receivers.html#x'>a page</a> <a href='#here'>here</a>"
          "<a href='https://example.com/'>away</a> <img src='img/gone.png'> <a href='guides/receivers%2Ehtml'>quoted</a>")
    _page(tmp_path / "404.html", "<a href='/guides/'>from the root, as a server shows it</a>")
    breaks = site_links.offline_breaks(str(tmp_path))
    assert breaks == ["index.html: guides/ (a directory)", "index.html: img/gone.png (missing)",
                      "guides/receivers.html: assets/x.css (missing)"]

