"""``python -m flows.cli``: the ``dcr`` command."""

import sys

from flows.cli import command

sys.exit(command())
