"""Check that the built site navigates from the disk (``file://``), with no web server.

A browser opening ``site/index.html`` from the disk shows a directory listing for a link that ends
in a directory (a server would answer with its ``index.html``), and nothing for a missing file.
``mkdocs.yml`` sets ``use_directory_urls: false`` so that every page is ``name.html``; the site's
hook (``tools/docs/hooks.py``) runs :func:`offline_breaks` after each build and fails it on any
link that does not name a file, so a theme, plugin or hand-written link cannot undo that.
"""

from __future__ import annotations

import os
from html.parser import HTMLParser
from urllib.parse import unquote, urlsplit

# Only a web server shows it (for a path it does not have), so its links are from the site's root.
SERVER_ONLY = {"404.html"}


class _Links(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.links: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.links.extend(value for name, value in attrs if name in ("href", "src") and value)


def offline_breaks(site_dir: str) -> list[str]:
    """Every link of the site's pages to a file of the site that is not there, or to a directory:
    ``"page: link (a directory)"`` or ``"page: link (missing)"``; links to other sites and to
    anchors of the same page are not checked."""
    breaks = []
    for directory, _, names in sorted(os.walk(site_dir)):
        for name in sorted(names):
            page = os.path.join(directory, name)
            rel_page = os.path.relpath(page, site_dir)
            if not name.endswith(".html") or rel_page in SERVER_ONLY:
                continue
            parser = _Links()
            with open(page, encoding="utf-8") as f:
                parser.feed(f.read())
            for link in dict.fromkeys(parser.links):
                parts = urlsplit(link)
                if parts.scheme or parts.netloc or not parts.path:
                    continue
                target = os.path.normpath(os.path.join(directory, unquote(parts.path)))
                if os.path.isdir(target):
                    breaks.append(f"{rel_page}: {link} (a directory)")
                elif not os.path.isfile(target):
                    breaks.append(f"{rel_page}: {link} (missing)")
    return breaks
