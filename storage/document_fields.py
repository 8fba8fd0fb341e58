"""Strict parsing of the fields of stored JSON documents (manifests, markers, partial manifests).

Each parser checks one field's type and range and fails with an ``IntegrityError`` naming the
document and the field, so a hostile or corrupted document is refused before anything uses it.
"""

from __future__ import annotations

import json
import re
from typing import Any

from dcr_core.codec import CodecSpec

try:
    import orjson as _orjson
except ImportError:  # the standard library's json alone: slower, the same documents
    _orjson = None  # type: ignore[assignment]

from dcr_core.errors import IntegrityError, UnsafeKeyError
from storage import layout

MAX_NDIM = 16
MAX_DIM = 1 << 48

_HEX = re.compile(r"^[0-9a-f]{64}$")
_HEX_DIGITS = b"0123456789abcdef"  # ASCII text of only these translates to nothing (one table pass in C)
_INTS = frozenset({int})


def all_ints(v: list, lo: int = 0, hi: int = 1 << 62) -> bool:
    """Whether every item of the list ``v`` is an integer (not a bool) in ``lo..hi``: the common case
    of a column, checked in a few passes in C (a caller that gets False parses item by item, for the
    error that names the bad one)."""
    return not v or (_INTS.issuperset(map(type, v)) and lo <= min(v) and max(v) <= hi)


def all_digests(v: list) -> bool:
    """Whether every item of the list ``v`` is a digest (64 lowercase hex digits), in a few passes in C."""
    if not v:
        return True
    if set(map(type, v)) != {str} or set(map(len, v)) != {64}:
        return False
    text = "".join(v)
    return text.isascii() and not text.encode("ascii").translate(None, _HEX_DIGITS)


def fail(what: str, msg: str) -> IntegrityError:
    return IntegrityError(f"{what}: {msg}")


def loads(data: bytes | str) -> Any:
    """``json.loads``, through orjson where it takes the text (2-3x faster on the large documents DCR
    reads: a manifest, a safetensors header of tens of thousands of tensors). What orjson refuses
    (it is strict: no NaN, no lone surrogate) goes to ``json.loads``, so what is accepted, and every
    error, is ``json``'s. One difference: an integer beyond 64 bits reads as a float, which every
    field DCR reads as an integer refuses as it refuses that integer (all are bounded far below)."""
    if _orjson is not None:
        try:
            return _orjson.loads(data)
        except _orjson.JSONDecodeError:
            pass
    return json.loads(data)


def dumps_line(obj: Any) -> str:
    """``obj`` as one line of compact JSON text, through orjson where it takes it (a table of
    70,000 tensors renders in milliseconds); ``json`` writes the same text otherwise."""
    if _orjson is not None:
        try:
            return _orjson.dumps(obj).decode()
        except _orjson.JSONEncodeError:  # a lone surrogate in a name: json writes it escaped
            pass
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)


def dumps_indented(obj: Any) -> bytes:
    """``obj`` as indented JSON text (two spaces), UTF-8, through orjson where it takes it."""
    if _orjson is not None:
        try:
            return _orjson.dumps(obj, option=_orjson.OPT_INDENT_2) + b"\n"
        except _orjson.JSONEncodeError:
            pass
    return json.dumps(obj, indent=2, ensure_ascii=False).encode("utf-8") + b"\n"


def document(data: bytes, where: str, fmt: str, what: str) -> dict:
    """The JSON object ``data`` holds, whose ``format`` is ``fmt``; else a one-line error naming
    ``where`` (not JSON, or "not a <what>")."""
    try:
        d = loads(data)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise fail(where, f"not valid JSON ({e})") from None
    if not isinstance(d, dict) or d.get("format") != fmt:
        raise fail(where, f"not a {what}")
    return d


def parse_columns(d: dict, what: str, table: str, *names: str) -> list[list[Any]]:
    """The columns ``names`` of table ``d`` (a manifest's chunks, parts, pieces): lists of one length."""
    columns: list[list[Any]] = []
    for name in names:
        column = d.get(name)
        if not isinstance(column, list) or (columns and len(column) != len(columns[0])):
            raise fail(what, f"{table}.{'/'.join(names)} must be lists of equal length")
        columns.append(column)
    return columns


def parse_codec(v: Any, what: str) -> CodecSpec:
    """A document's ``codec`` block (``dcr_core.codec.CodecSpec``)."""
    try:
        if not isinstance(v, dict):
            raise TypeError(f"expected an object, got {v!r}")
        return CodecSpec.from_dict(v)
    except (TypeError, KeyError, ValueError) as e:
        raise fail(what, f"bad codec ({e})") from None


def parse_int(v: Any, what: str, lo: int = 0, hi: int = 1 << 62) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise fail(what, f"expected an integer in {lo}..{hi}, got {v!r}")
    return v


def parse_digest(v: Any, what: str) -> str:
    if not isinstance(v, str) or not _HEX.match(v):
        raise fail(what, f"expected a 64-hex-digit digest, got {v!r}")
    return v


def parse_attempt(v: Any, what: str) -> str:
    try:
        return layout.check_attempt(v)
    except UnsafeKeyError as e:
        raise UnsafeKeyError(f"{what}: {e}") from None


def parse_shape(v: Any, what: str) -> tuple[int, ...]:
    if type(v) is list and len(v) <= MAX_NDIM and all_ints(v, 0, MAX_DIM):
        return tuple(v)
    if not isinstance(v, list) or len(v) > MAX_NDIM:
        raise fail(what, f"expected a list of at most {MAX_NDIM} dims, got {v!r}")
    return tuple(parse_int(d, what, 0, MAX_DIM) for d in v)


_RUN = re.compile(r"^[0-9a-f]{32}$")


def parse_run_id(v: Any, what: str) -> str:
    if not isinstance(v, str) or not _RUN.match(v):
        raise fail(what, f"expected a run id of 32 hex digits, got {v!r}")
    return v
