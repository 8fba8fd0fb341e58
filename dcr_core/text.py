"""Text that came from a bucket or a checkpoint, made safe to print on a terminal.

Tensor names, timestamps, lease names and error messages quote what someone wrote into the bucket
or the checkpoint. Printed raw, an ESC sequence in one sets the terminal's title, clears the screen
or rewrites lines a person is reading, and a newline forges a row of a table. ``printable`` writes
every control character (C0, DEL, C1) and the Unicode bidirectional overrides as a visible escape
(``\\x1b``, ``\\u202e``); newlines only where the caller lays out lines itself.

``plural`` puts a count with its noun in the form the count takes (``1 step``, ``2 steps``): every
line the commands print about a count goes through it.
"""

from __future__ import annotations

import re

_CONTROLS = "\x00-\x08\x0b-\x1f\x7f-\x9f\u200e\u200f\u202a-\u202e\u2066-\u2069"
_ANY = re.compile(f"[\n{_CONTROLS}]")
_BUT_NEWLINES = re.compile(f"[{_CONTROLS}]")


_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape(m: re.Match) -> str:
    c = m.group()
    if c in _NAMED:
        return _NAMED[c]
    return f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}"


def printable(text: object, newlines: bool = False) -> str:
    """``str(text)`` with control characters escaped (``newlines``: line breaks kept as they are)."""
    return (_BUT_NEWLINES if newlines else _ANY).sub(_escape, str(text))


def plural(n: int, noun: str, nouns: str | None = None, count: bool = True) -> str:
    """``n`` and ``noun`` in the form that count takes: ``1 step``, ``0 steps``, ``3 entries`` (``nouns``:
    a plural that is not ``noun + "s"``); ``count=False``: the noun alone."""
    word = noun if n == 1 else nouns or noun + "s"
    return f"{n} {word}" if count else word
