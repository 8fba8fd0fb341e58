"""The command-line reference page (``tools/docs/cli_reference.py``, generated at each site build)
as a reader at 1280 px gets it: each flag table inside the block the site's stylesheet keeps flags
and defaults whole in (no ``--orchestrato``/``r``), and no path of the machine that built it."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

_spec = importlib.util.spec_from_file_location("cli_reference", REPO / "tools" / "docs" / "cli_reference.py")
cli_reference = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cli_reference)


def test_every_flag_table_is_styled_to_keep_flags_whole_and_names_no_local_path():
    page = cli_reference.render()
    tables = page.count("| flag | kind | help | default |")
    wrapped = re.findall(r'<div class="cli-flags" markdown>\n\n\| flag \| kind \| help \| default \|\n.*?\n\n</div>\n', page, re.S)
    assert tables > 10 and len(wrapped) == tables
    css = (REPO / "docs" / "stylesheets" / "extra.css").read_text()
    assert ".cli-flags td:first-child code" in css and "white-space: nowrap" in css
    assert str(REPO) not in page  # `dcr serve --prefect-file` defaults to infra/prefect.yaml of the checkout
    assert "`infra/prefect.yaml`" in page
