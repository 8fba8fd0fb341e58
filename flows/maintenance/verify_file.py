"""``dcr verify ROOT --file PATH --step N``: is a local file (or directory) exactly step N?

For a step published from a safetensors file or directory, "exactly" means byte for byte the
published file(s): every header as published (``storage.source_layout``), each file's size, the
directory's index, and every tensor's bits. Nothing is downloaded but the step's manifest and its
source layout: the local tensors are hashed and compared with the manifest's digests (raw bits,
``TensorEntry.matches``). For a step published from tensors or shards there is no header to
compare: "exactly" means the same tensors (names, dtypes, shapes, bits).

The answer names the first difference (a missing file, a header, a size, a tensor whose bits
differ, the index) and says whether every tensor's bits are nevertheless the step's (a receiver's
state file holds the step's bits under DCR's own header).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np

from dcr_core.errors import InvalidCheckpointError
from dcr_core.text import plural
from storage import source_layout
from storage.catalog import Catalog
from storage.local.safetensors import INDEX_NAME, SafetensorsCheckpoint
from storage.manifest import Manifest
from storage.root import Root
from storage.source_layout import FILE, SourceFile


@dataclass
class FileVerdict:
    path: str
    step: int
    exact: bool  # the bytes are exactly the step (its published files; its tensors when it has none)
    tensors_match: bool  # every tensor of the step is there with its bits
    compared_files: bool  # the step was published from files: their headers, sizes and index compared too
    differences: list[str] = field(default_factory=list)  # in order: the first is the one to report
    tensors: int = 0  # tensors hashed
    nbytes: int = 0  # their bytes

    def message(self) -> str:
        if self.exact:
            return (f"{self.path} is exactly step {self.step}" if self.compared_files else
                    f"{self.path} holds exactly step {self.step}'s tensors (the step was published from tensors, "
                    "not a file: there is no header to compare)")
        first = self.differences[0]
        more = f" (and {len(self.differences) - 1} more differences)" if len(self.differences) > 1 else ""
        if self.tensors_match:
            bits = "; every tensor's bits are the step's"
        else:
            tensor = next((d for d in self.differences if d.startswith("tensor ")), None)
            bits = f"; {tensor}" if tensor is not None and tensor != first else ""
        return f"{self.path} is not step {self.step}: {first}{bits}{more}"


def _first_difference(a: bytes, b: bytes) -> int:
    n = min(len(a), len(b))
    differ = np.flatnonzero(np.frombuffer(a, np.uint8, n) != np.frombuffer(b, np.uint8, n))
    return int(differ[0]) if differ.size else n


def _hash_tensors(ck: SafetensorsCheckpoint, m: Manifest, names, label: str, verdict: FileVerdict) -> set[str]:
    """Compare the tensors ``names`` of ``ck`` with the step's; note each difference, return the
    names whose bits match."""
    matched = set()
    for name in names:
        e = m.tensors[name]
        info = ck.infos.get(name)
        if info is None:
            verdict.differences.append(f"tensor {name!r} is missing{label}")
            continue
        if (info.dtype, info.shape) != (e.dtype, e.shape):
            verdict.differences.append(f"tensor {name!r} is {info.dtype}{list(info.shape)}{label}, step {m.step} has "
                                       f"{e.dtype}{list(e.shape)}")
            continue
        verdict.tensors += 1
        verdict.nbytes += e.nbytes
        if e.matches(ck.mapped_bits(name)):
            matched.add(name)
        else:
            verdict.differences.append(f"tensor {name!r}{label}: its bits differ from step {m.step}'s")
    return matched


def _extra(ck: SafetensorsCheckpoint, expected, label: str, verdict: FileVerdict) -> None:
    for name in sorted(set(ck.infos) - set(expected)):
        verdict.differences.append(f"tensor {name!r}{label} is not in the published file")


def _compare_file(path: str, f: SourceFile, m: Manifest, label: str, verdict: FileVerdict) -> set[str]:
    """One local file against one published file: header bytes, size, then tensors in file order
    (``label``: "" for a single file, " (in NAME)" for a directory's)."""
    owner = f"{f.name}: " if label else ""
    if not os.path.isfile(path):
        verdict.differences.append(f"{f.name} is missing" if label else "not a file")
        return set()
    with open(path, "rb") as fh:
        head = fh.read(len(f.header))
        size = os.fstat(fh.fileno()).st_size
    if head != f.header:
        verdict.differences.append(f"{owner}its header differs from the published one (first at byte "
                                   f"{_first_difference(head, f.header)} of {len(f.header)})")
    if size != f.size:
        verdict.differences.append(f"{owner}it is {size} bytes, the published file {f.size}")
    try:
        ck = SafetensorsCheckpoint(path)
    except InvalidCheckpointError as e:
        verdict.differences.append(f"its tensors cannot be read ({e})")
        return set()
    with ck:
        matched = _hash_tensors(ck, m, list(f.placed), label, verdict)
        _extra(ck, f.placed, label, verdict)
    return matched


def verify_file(root: Root, step: int, path: str | os.PathLike) -> FileVerdict:
    """Compare the local file or directory ``path`` with committed step ``step`` (see the module doc)."""
    given = os.fspath(path)
    real = os.path.realpath(given)
    m = Catalog(root).manifest(step)
    lay = source_layout.read(root, m)
    verdict = FileVerdict(given, step, False, False, lay is not None)
    matched: set[str] = set()
    if not os.path.exists(real):
        verdict.differences.append("no such file or directory")
    elif lay is None:
        try:
            ck = SafetensorsCheckpoint(real)
        except InvalidCheckpointError as e:
            verdict.differences.append(f"not a safetensors checkpoint ({e})")
        else:
            with ck:
                matched = _hash_tensors(ck, m, sorted(m.tensors), "", verdict)
                _extra(ck, m.tensors, "", verdict)
    elif lay.kind == FILE:
        if os.path.isdir(real):
            verdict.differences.append(f"a directory; step {step} was published as one file")
        else:
            matched = _compare_file(real, lay.files[0], m, "", verdict)
    elif not os.path.isdir(real):
        verdict.differences.append(f"not a directory; step {step} was published as a directory of "
                                   f"{plural(len(lay.files), 'file')} ({lay.files[0].name}, ...)")
    else:
        for f in lay.files:
            matched |= _compare_file(os.path.join(real, f.name), f, m, f" (in {f.name})", verdict)
        index = os.path.join(real, INDEX_NAME)
        if lay.index is not None:
            try:
                with open(index, "rb") as fh:
                    held = fh.read(len(lay.index) + 1)
            except OSError:
                verdict.differences.append(f"{INDEX_NAME} is missing")
            else:
                if held != lay.index:
                    verdict.differences.append(f"{INDEX_NAME} differs from the published one (first at byte "
                                               f"{_first_difference(held, lay.index)})")
        elif os.path.exists(index):
            verdict.differences.append(f"{INDEX_NAME} is there; the published directory had none")
    verdict.tensors_match = matched == set(m.tensors)
    verdict.exact = not verdict.differences
    return verdict
