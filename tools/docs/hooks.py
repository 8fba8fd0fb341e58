"""MkDocs hooks of the documentation site (``hooks:`` in mkdocs.yml).

``reference/cli.md`` is not a file in ``docs/``: it is generated from the ``dcr`` argparse parsers
(``tools/docs/cli_reference.py``) at every build, so the command reference cannot drift from the code.
"""

from __future__ import annotations

import os
import sys

from mkdocs.structure.files import File

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import cli_reference  # the generator beside this file

CLI_PAGE = "reference/cli.md"


def on_files(files, config):
    files.append(File.generated(config, CLI_PAGE, content=cli_reference.render()))
    return files
