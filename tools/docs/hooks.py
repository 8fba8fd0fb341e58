"""MkDocs hooks of the documentation site (``hooks:`` in mkdocs.yml).

``reference/cli.md`` is not a file in ``docs/``: it is generated from the ``dcr`` argparse parsers
(``tools/docs/cli_reference.py``) at every build, so the command reference cannot drift from the code.
After the build, every link of the site must name a file, so that ``site/index.html`` opened from the
disk navigates (``tools/docs/site_links.py``).
"""

from __future__ import annotations

import os
import sys

from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import cli_reference  # the generator beside this file
import site_links

CLI_PAGE = "reference/cli.md"


def on_files(files, config):
    files.append(File.generated(config, CLI_PAGE, content=cli_reference.render()))
    return files


def on_post_build(config):
    breaks = site_links.offline_breaks(config["site_dir"])
    if breaks:
        shown = "\n  ".join(breaks[:20])
        raise PluginError(f"{len(breaks)} links of the site do not name a file (read from the disk, they break):\n  {shown}")
