"""The published file's own bytes: what rebuilding a safetensors checkpoint byte for byte needs.

A step published from a ``.safetensors`` file or a Hugging Face sharded directory keeps, beside its
manifest, ``source.json`` (``storage.layout.source_key``): a JSON document with, for each file of
the checkpoint, its name, its size and its header exactly as the trainer wrote it (the JSON text
with its own key order, whitespace and padding; the 8-byte length prefix is its length), and for a
directory the exact text of ``model.safetensors.index.json``. The tensors' bits are the step's; each
header says where they lie. The manifest names the document by digest and size
(``storage.manifest.SourceRecord``), so the commit marker's manifest digest (and a signature) covers
it, and ``read`` checks it before anything uses it. A person reads it in the bucket as it is.

Only files whose every byte is accounted for are kept: the length prefix, the header, and the
tensors' data, which must fill the rest of the file exactly (no gap between tensors, nothing after
the last). ``capture`` says why it keeps nothing otherwise (such a step materializes as a file in
DCR's own format, as steps published from tensors or shards do).
"""

from __future__ import annotations

import functools
import math
import os
import struct
from dataclasses import dataclass, field

import blake3

from dcr_core.dtypes import DTYPES, TensorInfo
from dcr_core.errors import IntegrityError
from storage import layout
from storage.document_fields import MAX_DIM, MAX_NDIM, document, dumps_indented, fail, parse_int
from storage.local.safetensors import INDEX_NAME, MAX_HEADER_BYTES, SafetensorsCheckpoint, header_doc, header_entries
from storage.manifest import MAX_SOURCE_BYTES, Manifest, SourceRecord
from storage.root import Root

FORMAT = "dcr-source-layout"
VERSION = 1
FILE, DIRECTORY = "file", "directory"
MAX_FILES = 100_000
MAX_NAME_BYTES = 255
SUFFIX = ".safetensors"


class Unkept(ValueError):
    """Why a checkpoint's files cannot be rebuilt byte for byte (said, and the step published without them)."""


@dataclass(frozen=True)
class SourceFile:
    """One file of the checkpoint: its name, its header as stored (length prefix and JSON text), its
    size, and each tensor's place in it (``placed[name] = (byte offset, bytes)``, in file order)."""

    name: str
    header: bytes
    size: int
    infos: dict[str, TensorInfo] = field(repr=False)
    placed: dict[str, tuple[int, int]] = field(repr=False)

    def to_dict(self) -> dict:
        return {"name": self.name, "bytes": self.size, "header_bytes": len(self.header) - 8,
                "header": self.header[8:].decode("utf-8")}


@dataclass(frozen=True)
class SourceLayout:
    """Every file of a published checkpoint (one for a file; a directory's shards, in name order)."""

    kind: str
    files: tuple[SourceFile, ...]
    index: bytes | None = None  # the directory's model.safetensors.index.json, exactly (None: it had none)

    def to_json(self) -> bytes:
        return self._json

    @functools.cached_property
    def _json(self) -> bytes:
        """The document, rendered once (a header of 70,000 tensors is megabytes of JSON text, and a
        publish asks for its digest, its bytes and its record)."""
        doc = {"format": FORMAT, "version": VERSION, "kind": self.kind, "files": [f.to_dict() for f in self.files],
               "index": None if self.index is None else {"name": INDEX_NAME, "text": self.index.decode("utf-8")}}
        return dumps_indented(doc)

    def digest(self) -> str:
        return digest(self.to_json())

    def record(self) -> SourceRecord:
        data = self.to_json()
        return SourceRecord(self.kind, digest(data), len(data))

    def file_of(self) -> dict[str, SourceFile]:
        """The file that holds each tensor."""
        return {n: f for f in self.files for n in f.placed}

    def check(self, tensors, where: str) -> None:
        """The files hold exactly these tensors (``(name, dtype, shape, ...)`` records: a manifest's
        ``policy_entries``), with their dtypes and shapes."""
        held = {n: (i.dtype, i.shape) for f in self.files for n, i in f.infos.items()}
        tensors = {t[0]: (t[1], tuple(t[2])) for t in tensors}
        if held == tensors:  # the common case: one comparison of the two tables, in C
            return
        if set(held) != set(tensors):
            odd = sorted(set(held) ^ set(tensors))[0]
            raise IntegrityError(f"{where}: tensor {odd!r} is not in both the step's manifest and its source files")
        name = min(n for n, e in tensors.items() if held[n] != e)
        raise IntegrityError(f"{where}: tensor {name!r} has another dtype or shape than in the step's manifest")

    @classmethod
    def from_json(cls, data: bytes, where: str) -> SourceLayout:
        """Parse and check a source layout (a damaged or hostile one fails naming ``where``)."""
        if len(data) > MAX_SOURCE_BYTES:
            raise fail(where, f"{len(data)} bytes exceeds the limit {MAX_SOURCE_BYTES}")
        d = document(data, where, FORMAT, "DCR source layout")
        if d.get("version") != VERSION or isinstance(d.get("version"), bool):
            raise fail(where, f"version {d.get('version')!r} is not supported (this DCR reads {VERSION})")
        kind = d.get("kind")
        if kind not in (FILE, DIRECTORY):
            raise fail(where, f"kind must be {FILE} or {DIRECTORY}, got {kind!r}")
        raw_files = d.get("files")
        if not isinstance(raw_files, list) or not 1 <= len(raw_files) <= (1 if kind == FILE else MAX_FILES):
            raise fail(where, f"files must be a list of 1 to {1 if kind == FILE else MAX_FILES} entries")
        files = tuple(_parse_file(f, where) for f in raw_files)
        names = [f.name for f in files]
        if len(set(names)) != len(names):
            raise fail(where, "two files have one name")
        seen: set[str] = set()
        for f in files:
            if seen & set(f.placed):
                raise fail(where, f"tensor {sorted(seen & set(f.placed))[0]!r} is in two files")
            seen |= set(f.placed)
        index = d.get("index")
        if index is not None:
            if kind != DIRECTORY or not isinstance(index, dict) or index.get("name") != INDEX_NAME \
                    or not isinstance(index.get("text"), str):
                raise fail(where, f"index must be null or, for a directory, {{'name': {INDEX_NAME!r}, 'text': ...}}")
            index = _utf8(index["text"], f"{where} index")
        return cls(kind, files, index)


def digest(data: bytes) -> str:
    return blake3.blake3(data).hexdigest()


def _utf8(text: str, where: str) -> bytes:
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:
        raise fail(where, "text is not valid Unicode (a lone surrogate)") from None


def _check_name(name, where: str) -> str:
    try:
        size = len(name.encode("utf-8")) if isinstance(name, str) else None
    except UnicodeEncodeError:  # a file name that is not UTF-8 on disk
        size = None
    if size is None or size > MAX_NAME_BYTES or not name.endswith(SUFFIX) or name.startswith(".") \
            or any(c in name for c in "/\\\0"):
        raise fail(where, f"file name {name!r} is not a plain *{SUFFIX} name")
    return name


def _parse_file(d, where: str) -> SourceFile:
    if not isinstance(d, dict):
        raise fail(where, "each file must be an object")
    name = _check_name(d.get("name"), where)
    what = f"{where} file {name!r}"
    n = parse_int(d.get("header_bytes"), what, 0, MAX_HEADER_BYTES)
    if not isinstance(d.get("header"), str):
        raise fail(what, "header must be a string")
    text = _utf8(d["header"], what)
    if len(text) != n:
        raise fail(what, f"header is {len(text)} bytes, header_bytes says {n}")
    size = parse_int(d.get("bytes"), what, 8 + n)
    try:
        infos, placed = placement(text, size, what)
    except Unkept as e:
        raise fail(what, str(e)) from None
    return SourceFile(name, struct.pack("<Q", n) + text, size, infos, placed)


@functools.lru_cache(maxsize=4)
def placement(text: bytes, size: int, what: str) -> tuple[dict[str, TensorInfo], dict[str, tuple[int, int]]]:
    """The tensors a safetensors header (its JSON bytes) describes and where each lies in a file of
    ``size`` bytes, in file order; ``Unkept`` unless the tensors fill the file after the header
    exactly."""
    try:
        doc = header_doc(text)
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise Unkept("its header is not JSON") from None
    if not isinstance(doc, dict):
        raise Unkept("its header is not a JSON object")
    start = 8 + len(text)
    spans = []
    infos: dict[str, TensorInfo] = {}
    for name, e in doc.items():
        if name == "__metadata__":
            continue
        try:
            dt = DTYPES[e["dtype"]]
            shape = tuple(e["shape"])
            a, b = e["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise Unkept(f"tensor {name!r} has a malformed header entry") from None
        if len(shape) > MAX_NDIM or not all(type(x) is int for x in shape) or any(x < 0 or x > MAX_DIM for x in shape) \
                or not all(type(x) is int for x in (a, b)) or not 0 <= a <= b \
                or b - a != math.prod(shape) * dt.itemsize:
            raise Unkept(f"tensor {name!r} has inconsistent shape/offsets")
        infos[name] = TensorInfo(name, dt.name, shape)
        spans.append((a, b, name))
    spans.sort()
    return infos, _fill(spans, start, size)


def _fill(spans: list[tuple[int, int, str]], start: int, size: int) -> dict[str, tuple[int, int]]:
    """Where each tensor lies (file offset, bytes) given its data span, in file order; ``Unkept``
    unless the spans fill the file after the header (``start`` bytes) exactly."""
    at = 0
    placed: dict[str, tuple[int, int]] = {}
    for a, b, name in spans:
        if a == b:  # an empty tensor occupies nothing; its offset only has to lie within the data
            if a > size - start:
                raise Unkept(f"tensor {name!r} lies beyond the end of the file")
        elif a != at:
            raise Unkept(f"bytes {start + at}..{start + a} belong to no tensor" if a > at
                         else f"tensors overlap at byte {start + a}")
        else:
            at = b
        placed[name] = (start + a, b - a)
    if start + at != size:
        raise Unkept(f"its last {size - start - at} bytes belong to no tensor" if size > start + at
                     else f"it is {size} bytes, its header needs {start + at}")
    return placed


@functools.lru_cache(maxsize=4)
def _placed(raw: bytes, size: int) -> tuple[dict[str, TensorInfo], dict[str, tuple[int, int]]]:
    """``placement`` of a file with header ``raw`` (length prefix included) and ``size`` bytes, from
    what opening it checked already (``safetensors.header_entries``: each tensor's dtype, shape and
    data offset): whether the tensors fill the file after its header exactly, in file order."""
    infos, _, starts, _ = header_entries(raw)
    sizes = {k: d.itemsize for k, d in DTYPES.items()}
    spans = sorted((starts[n], starts[n] + math.prod(i.shape) * sizes[i.dtype], n) for n, i in infos.items())
    return infos, _fill(spans, len(raw), size)


def capture(ck: SafetensorsCheckpoint) -> SourceLayout:
    """The layout of an opened checkpoint (a file, or a sharded directory and its index), as read
    when it was opened; ``Unkept`` says why its files cannot be rebuilt byte for byte. A publish
    captures its checkpoint when it plans and again before it commits (to see that nothing
    changed): the same files give the same layout object, rendered once."""
    kind = DIRECTORY if os.path.isdir(ck.path) else FILE
    index = None
    if kind == DIRECTORY and os.path.exists(os.path.join(ck.path, INDEX_NAME)):
        with open(os.path.join(ck.path, INDEX_NAME), "rb") as f:
            index = f.read()
    return _layout(kind, ck.path, tuple((path, head.raw, ck.sizes[path]) for path, head in ck.headers.items()), index)


@functools.lru_cache(maxsize=2)
def _layout(kind: str, where: str, files_read: tuple[tuple[str, bytes, int], ...], index: bytes | None) -> SourceLayout:
    """``capture`` of the files ``files_read`` (path, header bytes, size) and ``index``."""
    files = []
    for path, raw, size in files_read:
        name = os.path.basename(path)
        try:
            if kind == DIRECTORY:
                _check_name(name, path)
            raw[8:].decode("utf-8")
            infos, placed = _placed(raw, size)
        except UnicodeDecodeError:
            raise Unkept(f"{path}: its header is not UTF-8 text") from None
        except IntegrityError:
            raise Unkept(f"{path}: its name is not a plain *{SUFFIX} name") from None
        except Unkept as e:
            raise Unkept(f"{path}: {e}") from None
        if kind == FILE:  # only for people: the file is written where --out says
            try:
                _check_name(name, path)
            except IntegrityError:
                name = "model" + SUFFIX
        files.append(SourceFile(name, raw, size, infos, placed))
    if index is not None:
        try:
            index.decode("utf-8")
        except UnicodeDecodeError:
            raise Unkept(f"{os.path.join(where, INDEX_NAME)}: not UTF-8 text") from None
    return SourceLayout(kind, tuple(files), index)


def read(root: Root, m: Manifest) -> SourceLayout | None:
    """The source layout of a step (``m``: its verified manifest), checked against the digest and
    size the manifest gives and against its tensors; None when the step has none."""
    if m.source is None:
        return None
    key = layout.source_key(m.step, m.attempt)
    where = f"{root.url}/{key}"
    try:
        data = root.read(key, limit=m.source.nbytes)
    except FileNotFoundError:
        raise IntegrityError(f"{where}: the source layout named by the manifest is missing") from None
    if len(data) != m.source.nbytes or digest(data) != m.source.digest:
        raise IntegrityError(f"{where}: source layout does not match the digest its manifest gives")
    lay = SourceLayout.from_json(data, where)
    if lay.kind != m.source.kind:
        raise IntegrityError(f"{where}: a {lay.kind}, the manifest says a {m.source.kind}")
    lay.check(m.policy_entries(), where)
    return lay
