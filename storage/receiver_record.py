"""A receiver's record: ``steps/N/receivers/ID.json`` (its commit of step N) and ``receivers/ID.json``
(where it is now), written by ``Catalog.record_receiver``.

A record is what a receiver says of itself, and anyone who may write ``receivers/`` may write one:
it is advisory (no refit trusts it) and validated as a document before anything shows or counts it.
Each field read is checked for its type and range, so a record of the wrong shape fails with one
``IntegrityError`` naming the object and the field, and is shown as damaged on its own; fields this
version does not read are kept as they are.
"""

from __future__ import annotations

import json
from typing import Any

from storage import layout
from storage.document_fields import fail, parse_int

MAX_RECORD_BYTES = 64 << 10  # a receiver record or position: a few hundred bytes
MAX_MOVES = 1 << 16  # more moves than any refit makes


def _optional_int(doc: dict, name: str, where: str, hi: int = 1 << 62) -> None:
    if doc.get(name) is not None:
        parse_int(doc[name], f"{where}: {name}", 0, hi)


def _optional_str(doc: dict, name: str, where: str) -> None:
    if doc.get(name) is not None and not isinstance(doc[name], str):
        raise fail(where, f"{name}: expected text, got {doc[name]!r}")


def check_fields(doc: Any, where: str, step: int | None = None) -> dict:
    """``doc`` if it is a receiver record (of ``step``, if given), else an ``IntegrityError``."""
    if not isinstance(doc, dict):
        raise fail(where, f"not a receiver record (a JSON object), got {type(doc).__name__}")
    parse_int(doc.get("step"), f"{where}: step", 0, layout.MAX_STEP)
    if step is not None and doc["step"] != step:
        raise fail(where, f"step: a visit of step {step} names step {doc['step']}")
    _optional_int(doc, "from_step", where, layout.MAX_STEP)
    _optional_int(doc, "bytes_pulled", where)
    for name in ("receiver", "committed_at", "policy_digest", "mirror"):
        _optional_str(doc, name, where)
    moves = doc.get("moves")
    if moves is not None and not (isinstance(moves, list) and len(moves) <= MAX_MOVES
                                  and all(isinstance(m, str) for m in moves)):
        raise fail(where, f"moves: expected a list of text, got {moves!r:.80}")
    return doc


def parse(data: bytes, where: str) -> dict:
    """The receiver record ``data`` holds, validated, its earlier visits too (each a record of the
    same step); else one ``IntegrityError`` naming ``where`` and the field."""
    try:
        doc = json.loads(data)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise fail(where, f"not valid JSON ({e})") from None
    check_fields(doc, where)
    earlier = doc.get("earlier")
    if earlier is not None:
        if not isinstance(earlier, list):
            raise fail(where, f"earlier: expected a list of visits, got {earlier!r:.80}")
        for i, visit in enumerate(earlier):
            check_fields(visit, f"{where}: earlier[{i}]", doc["step"])
            if "earlier" in visit:
                raise fail(where, f"earlier[{i}]: a visit holds no earlier visits")
    return doc
