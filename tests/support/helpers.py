"""Test data for DCR: "nasty" canonical checkpoints, the next training step, bit-exact comparison.

Everything here works on raw bits. Special values are written as bit patterns into unsigned
views, never produced by float arithmetic, so NaN payloads, -0.0 and subnormals are exactly the
ones intended. Byte order is little-endian (the only order DCR supports).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import threading
import time
from collections.abc import Callable, Hashable, Mapping

import numpy as np
import torch
from safetensors.torch import save_file

from dcr_core.bits import dtype_of, torch_dtype
from dcr_core.chunking import ChunkGrid
from dcr_core.dtypes import DTYPES
from storage import layout

# Shapes every dtype gets: 0-d, empty, empty with an inner zero, shapes not divisible by any small
# chunk, one large enough to give many chunks at chunk_bytes of 64..512.
SHAPES: dict[str, tuple[int, ...]] = {
    "scalar": (),
    "empty": (0,),
    "empty3d": (3, 0, 2),
    "vec": (37,),
    "mat": (13, 11),
    "cube": (3, 5, 7),
}

# Raw bit patterns of special values, by dtype (little-endian unsigned integers of the dtype's
# width). For floats: quiet NaNs with distinct payloads and signs, a signalling NaN, +0.0, -0.0,
# +inf, -inf, the smallest and largest positive subnormals and a negative subnormal.
SPECIALS: dict[str, list[int]] = {
    "BF16": [0x7FC1, 0xFFA5, 0x7F81, 0x0000, 0x8000, 0x7F80, 0xFF80, 0x0001, 0x007F, 0x8001],
    "F16": [0x7E01, 0xFE55, 0x7C01, 0x0000, 0x8000, 0x7C00, 0xFC00, 0x0001, 0x03FF, 0x8001],
    "F32": [
        0x7FC00001, 0xFFC12345, 0x7F800001, 0x00000000, 0x80000000,
        0x7F800000, 0xFF800000, 0x00000001, 0x007FFFFF, 0x80000001,
    ],
    "F64": [
        0x7FF8000000000001, 0xFFF8DEADBEEF0001, 0x7FF0000000000001, 0x0, 0x8000000000000000,
        0x7FF0000000000000, 0xFFF0000000000000, 0x1, 0x000FFFFFFFFFFFFF, 0x8000000000000001,
    ],
    # complex64: (real, imag) f32 pairs packed little-endian (real in the low 32 bits).
    "C64": [
        0x7FC00001_00000000, 0x80000000_FFC12345, 0x7F800001_7F800000, 0x0, 0x80000000_80000000,
        0xFF800000_7F800000, 0x00000001_80000001, 0x007FFFFF_3F800000,
    ],
    # e4m3fn: NaN is S.1111.111, no infinities; e5m2: IEEE-like with inf and NaN payloads.
    "F8_E4M3": [0x7F, 0xFF, 0x00, 0x80, 0x01, 0x07, 0x81, 0x7E],
    "F8_E5M2": [0x7D, 0xFE, 0x7F, 0x00, 0x80, 0x7C, 0xFC, 0x01, 0x03, 0x81],
    # fnuz: 0x80 is the only NaN (there is no -0.0), no infinities.
    "F8_E4M3FNUZ": [0x80, 0x00, 0x01, 0x07, 0x81, 0x7F, 0xFF],
    "F8_E5M2FNUZ": [0x80, 0x00, 0x01, 0x03, 0x81, 0x7F, 0xFF],
    "I8": [0x80, 0x7F, 0xFF, 0x00],
    "U8": [0xFF, 0x00, 0x80],
    "I16": [0x8000, 0x7FFF, 0xFFFF, 0x0000],
    "U16": [0xFFFF, 0x0000, 0x8000],
    "I32": [0x80000000, 0x7FFFFFFF, 0xFFFFFFFF, 0x0],
    "U32": [0xFFFFFFFF, 0x0, 0x80000000],
    "I64": [0x8000000000000000, 0x7FFFFFFFFFFFFFFF, 0xFFFFFFFFFFFFFFFF, 0x0],
    "U64": [0xFFFFFFFFFFFFFFFF, 0x0, 0x8000000000000000],
    "BOOL": [1, 0, 1, 1, 0],
}

FLOAT_DTYPES = {"BF16", "F16", "F32", "F64", "C64", "F8_E4M3", "F8_E5M2", "F8_E4M3FNUZ", "F8_E5M2FNUZ"}

# Sign bit masks (C64: both halves).
SIGN_MASK = {
    "BF16": 0x8000, "F16": 0x8000, "F32": 0x80000000, "F64": 0x8000000000000000,
    "C64": 0x80000000_80000000, "F8_E4M3": 0x80, "F8_E5M2": 0x80,
    "F8_E4M3FNUZ": 0x80, "F8_E5M2FNUZ": 0x80,
}

# A mantissa bit whose flip keeps a NaN a NaN (used to change NaN payloads).
NAN_PAYLOAD_BIT = {"BF16": 0x2, "F16": 0x2, "F32": 0x2, "F64": 0x2, "C64": 0x2, "F8_E5M2": 0x2}

# Tensors that never change between steps (``next_step`` leaves them alone).
FROZEN_MARK = "frozen"

# Extra names that exercise Zarr array-name escaping.
ODD_NAMES = ["model.layers.0/attn weight", "ünïcødé.bias", ".hidden", "a%2Fb"]


def _rng(seed: int, *parts: object) -> np.random.Generator:
    h = hashlib.blake2b(repr((seed, *parts)).encode(), digest_size=8).digest()
    return np.random.default_rng(int.from_bytes(h, "little"))


def raw_bits(t: torch.Tensor) -> np.ndarray:
    """The raw bits of ``t`` as a flat numpy array of the dtype's unsigned storage type."""
    dt = dtype_of(t)
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().view(dt.storage).copy()


def raw_bytes(t: torch.Tensor) -> bytes:
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def from_bits(bits: np.ndarray, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor of ``dtype``/``shape`` holding exactly ``bits`` (copied)."""
    dt = DTYPES[dtype]
    bits = np.ascontiguousarray(np.asarray(bits, dtype=dt.storage).reshape(-1)).copy()
    u8 = torch.from_numpy(bits.view(np.uint8))
    return u8.view(torch_dtype(dt)).reshape(shape).clone()


def dtype_name(t: torch.Tensor) -> str:
    return dtype_of(t).name


def read_state(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file or sharded directory, as read through DCR's reader."""
    from storage.local.safetensors import SafetensorsCheckpoint

    ck = SafetensorsCheckpoint(path)
    try:
        return {n: from_bits(ck.bits(n), i.dtype, i.shape) for n, i in ck.infos.items()}
    finally:
        ck.close()


def write_safetensors(path: str | os.PathLike, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None) -> None:
    """Write ``tensors`` to ``path`` with the safetensors library (a checkpoint as trainers write them)."""
    os.makedirs(os.path.dirname(os.path.abspath(os.fspath(path))), exist_ok=True)
    save_file({n: t.contiguous() for n, t in tensors.items()}, os.fspath(path), metadata=dict(metadata or {}))


def random_bits(rng: np.random.Generator, dtype: str, n: int) -> np.ndarray:
    """``n`` random elements' bits of ``dtype`` (bools are 0/1, everything else any pattern)."""
    dt = DTYPES[dtype]
    if dtype == "BOOL":
        return rng.integers(0, 2, size=n, dtype=np.uint8)
    raw = rng.integers(0, 256, size=n * dt.itemsize, dtype=np.uint8)
    return raw.view(dt.storage).copy()


def nasty_tensor(dtype: str, shape: tuple[int, ...], seed: int = 0, tag: str = "") -> torch.Tensor:
    """Random bits with the dtype's special values written into the first elements."""
    n = math.prod(shape)
    rng = _rng(seed, dtype, shape, tag)
    bits = random_bits(rng, dtype, n)
    specials = np.array(SPECIALS[dtype], dtype=DTYPES[dtype].storage)
    if n == 1:
        bits[0] = specials[int(rng.integers(0, len(specials)))]
    else:
        k = min(n, len(specials))
        bits[:k] = specials[:k]
        # Sprinkle more specials (incl. the 0-d-free positions) through the rest.
        if n > 2 * k:
            pos = rng.choice(np.arange(k, n), size=min(n - k, 2 * k), replace=False)
            bits[pos] = specials[rng.integers(0, len(specials), size=pos.size)]
    return from_bits(bits, dtype, shape)


def nasty_checkpoint(
    seed: int = 0, dtypes: list[str] | None = None, odd_names: bool = True, big: int = 0, wide: bool = False,
) -> dict[str, torch.Tensor]:
    """A canonical checkpoint: every dtype in every odd shape, special values, odd names.

    Names: ``<dtype>.<shape-kind>``; one ``<dtype>.frozen`` tensor per dtype that ``next_step``
    never changes; a few names that need escaping as Zarr array names; and, if ``big``, a frozen
    F32 tensor of ``big`` rows of 257 elements (a large unchanged embedding: it makes keyframes
    expensive next to deltas, as in real models). ``wide``: per dtype also ``<dtype>.wide`` (37, 12)
    and ``<dtype>.wide3d`` (3, 9, 8), whose last dims 4 divides: column blocks (with row edges).
    """
    out: dict[str, torch.Tensor] = {}
    for dtype in dtypes or list(DTYPES):
        for kind, shape in SHAPES.items():
            out[f"{dtype}.{kind}"] = nasty_tensor(dtype, shape, seed, kind)
        out[f"{dtype}.{FROZEN_MARK}"] = nasty_tensor(dtype, (9, 2), seed, FROZEN_MARK)
        if wide:
            out[f"{dtype}.wide"] = nasty_tensor(dtype, (37, 12), seed, "wide")
            out[f"{dtype}.wide3d"] = nasty_tensor(dtype, (3, 9, 8), seed, "wide3d")
    if odd_names:
        pool = dtypes or list(DTYPES)
        for i, name in enumerate(ODD_NAMES):
            out[name] = nasty_tensor(pool[(3 * i + 10) % len(pool)], (4, 3), seed, name)
    if big:
        out[f"embed.{FROZEN_MARK}"] = nasty_tensor("F32", (big, 257), seed, "big")
    return out


def next_step(
    prev: Mapping[str, torch.Tensor],
    seed: int,
    fraction: float = 0.05,
    unchanged: float = 0.2,
    ulps: float = 0.0,
) -> dict[str, torch.Tensor]:
    """The next training step of ``prev``: a controlled fraction of elements' bits flipped.

    - tensors whose name contains ``FROZEN_MARK``, and a further ``unchanged`` share chosen by the
      seed, keep every bit;
    - every other non-empty tensor gets ``max(1, round(fraction * numel))`` elements XORed with a
      random non-zero mask; for floats, the sign bit of every +0.0/-0.0 element is flipped
      (+0.0 <-> -0.0, equal as floats, different in bits) and NaN payloads change;
    - 0-d tensors always change when they are not left unchanged;
    - with ``ulps``, that share of the chosen elements instead moves by a signed step of 1-3 units
      of the bits' sign-magnitude integer (an optimizer's ulp steps: integer stepping, so NaN payloads,
      infinities, subnormals, +-0.0 and the largest values step too, and may wrap into the sign bit or
      change exponent: the cases a step coder must escape).
    """
    out: dict[str, torch.Tensor] = {}
    for name in sorted(prev):
        t = prev[name]
        dtype = dtype_name(t)
        shape = tuple(t.shape)
        bits = raw_bits(t)
        rng = _rng(seed, "step", name)
        n = bits.size
        if FROZEN_MARK in name or n == 0 or (shape != () and rng.random() < unchanged):
            out[name] = t.clone()
            continue
        dt = DTYPES[dtype]
        if dtype == "BOOL":
            masks = np.ones(n, dtype=np.uint8)
        else:
            masks = random_bits(rng, dtype, n)
            masks[masks == 0] = 1
        k = max(1, round(fraction * n))
        pos = rng.choice(n, size=min(k, n), replace=False)
        stepped = pos[: round(ulps * pos.size)] if dtype != "BOOL" else pos[:0]
        pos = pos[stepped.size :]
        bits[pos] ^= masks[pos]
        if stepped.size:
            steps = rng.integers(1, 4, size=stepped.size).astype(np.int64) * rng.choice([-1, 1], size=stepped.size)
            width = 8 * dt.itemsize
            sign = 1 << (width - 1)
            old_ = bits[stepped].astype(np.uint64).astype(object)  # exact big integers: no wrap surprises
            new_ = []
            for b, d in zip(old_, steps.tolist()):
                mag = (b & (sign - 1)) + d
                new_.append(((b & sign) | (mag % (1 << width))) % (1 << width) if mag >= 0 else (b ^ sign) | (-mag))
            bits[stepped] = np.array(new_, dtype=object).astype(np.uint64).astype(dt.storage)
        if dtype in SIGN_MASK:
            sign = dt.storage.type(SIGN_MASK[dtype])
            zeros = (bits & ~sign) == 0
            bits[zeros] ^= sign  # +0.0 <-> -0.0
        if dtype in NAN_PAYLOAD_BIT:
            is_nan = _is_nan(bits, dtype)
            bits[is_nan] ^= dt.storage.type(NAN_PAYLOAD_BIT[dtype])
        out[name] = from_bits(bits, dtype, shape)
    return out


def _is_nan(bits: np.ndarray, dtype: str) -> np.ndarray:
    """Which elements are NaNs whose payload bit 1 can flip while staying NaN (payload has another bit set)."""
    exp_mant = {
        "BF16": (0x7F80, 0x007F), "F16": (0x7C00, 0x03FF), "F32": (0x7F800000, 0x007FFFFF),
        "F64": (0x7FF0000000000000, 0x000FFFFFFFFFFFFF), "C64": (0x7F800000, 0x007FFFFF),
        "F8_E5M2": (0x7C, 0x03),
    }[dtype]
    e, m = (bits.dtype.type(x) for x in exp_mant)
    b = bits
    if dtype == "C64":
        b = (bits & np.uint64(0xFFFFFFFF)).astype(np.uint32)
        e, m = np.uint32(exp_mant[0]), np.uint32(exp_mant[1])
    mant = b & m
    return ((b & e) == e) & (mant != 0) & ((mant & ~type(m)(2)) != 0)


def chain_of_steps(n: int, seed: int = 0, ulps: float = 0.0, **kwargs) -> list[dict[str, torch.Tensor]]:
    """``n`` checkpoints: a nasty keyframe and ``n - 1`` successive steps (``ulps``: see ``next_step``)."""
    steps = [nasty_checkpoint(seed, **kwargs)]
    for i in range(1, n):
        steps.append(next_step(steps[-1], seed * 1000 + i, ulps=ulps))
    return steps


def assert_bits_equal(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> None:
    """Same names, dtypes, shapes and raw bytes; the message names the first differing tensor."""
    if set(a) != set(b):
        only_a, only_b = sorted(set(a) - set(b)), sorted(set(b) - set(a))
        raise AssertionError(f"tensor names differ: only in first {only_a[:5]}, only in second {only_b[:5]}")
    for name in sorted(a):
        x, y = a[name], b[name]
        if x.dtype != y.dtype:
            raise AssertionError(f"tensor {name!r}: dtype {x.dtype} != {y.dtype}")
        if tuple(x.shape) != tuple(y.shape):
            raise AssertionError(f"tensor {name!r}: shape {tuple(x.shape)} != {tuple(y.shape)}")
        xb = x.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        yb = y.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        if not torch.equal(xb, yb):
            diff = int(torch.nonzero(xb != yb)[0, 0]) // max(1, x.element_size())
            raise AssertionError(f"tensor {name!r}: raw bits differ (first at element {diff})")


def differs(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> set[str]:
    """Names of tensors whose raw bits differ between ``a`` and ``b`` (same names assumed)."""
    return {n for n in a if raw_bytes(a[n]) != raw_bytes(b[n])}


def tree_snapshot(path: str | os.PathLike) -> dict[str, bytes]:
    """Every file under ``path`` (relative name -> bytes), to check that nothing changed."""
    out: dict[str, bytes] = {}
    path = os.fspath(path)
    if not os.path.exists(path):
        return out
    for dirpath, _dirs, files in os.walk(path):
        for f in files:
            full = os.path.join(dirpath, f)
            with open(full, "rb") as fh:
                out[os.path.relpath(full, path)] = fh.read()
    return out


def file_bytes(path: str | os.PathLike) -> bytes | None:
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        return None


def attempt_objects(root: str, step: int) -> tuple[dict[str, bytes], dict]:
    """Every stored object of ``step``'s committed attempt (relative to it, stream indexes aside) and
    its manifest with what differs between any two publishes (attempt id, time) taken out. A packed
    step's chunks are listed as if each were its own object (``data.zarr/<array>/c/...``, its bytes
    cut from its pack), and where the packs are is taken out of the manifest: which chunks share a
    pack, and in what order, depends on which upload thread finished first."""
    marker = json.loads(open(os.path.join(root, layout.commit_key(step))).read())
    attempt_dir = os.path.dirname(os.path.join(root, layout.manifest_key(step, marker["attempt"])))
    objects = {}
    for dirpath, _, files in os.walk(attempt_dir):
        for f in files:
            rel = os.path.relpath(os.path.join(dirpath, f), attempt_dir)
            if not rel.startswith("stream/"):  # announcements: per chunk in one process, per group on workers
                objects[rel] = open(os.path.join(dirpath, f), "rb").read()
    manifest = json.loads(objects.pop(os.path.basename(layout.manifest_key(step, marker["attempt"]))))
    packs = manifest.pop("packs", [])
    for table in ("tensors", "snapshot"):
        for t in manifest.get(table, {}).values():
            c = t["chunks"]
            if "pack" not in c:
                continue
            grid = ChunkGrid(tuple(t["shape"]), tuple(t["chunk_shape"]))
            for index, pack, offset, n in zip(c["indices"], c.pop("pack"), c.pop("offset"), c["nbytes"]):
                data = objects[f"{layout.STORE}/{layout.pack_key(packs[pack])}"]
                objects[f"{layout.STORE}/{layout.chunk_key(t['array'], grid.grid_index(index))}"] = data[offset:offset + n]
    for name in [k for k in objects if k.startswith(f"{layout.STORE}/{layout.PACKS}/")]:
        del objects[name]
    for k in ("attempt", "created_at", "created", "time", "schema_version"):
        manifest.pop(k, None)
    return objects, manifest


def chunk_at(root: str | os.PathLike, step: int, tensor: str, pos: int = 0, snapshot: bool = False) -> tuple[str, int, int]:
    """Where the ``pos``-th stored chunk of ``tensor`` at committed ``step`` lies under a local ROOT:
    ``(file, offset, bytes)`` (a pack and the chunk's range in it, or its own object from 0)."""
    from storage.manifest import Manifest

    marker = json.loads(open(os.path.join(root, layout.commit_key(step))).read())
    key = layout.manifest_key(step, marker["attempt"])
    m = Manifest.from_json(open(os.path.join(root, key), "rb").read(), key)
    e = (m.snapshot if snapshot else m.tensors)[tensor]
    rel, _, _, nbytes = e.stored_at(pos)
    return os.path.join(root, layout.store_key(step, marker["attempt"], rel)), e.offset_at(pos) or 0, nbytes


def damage_chunk(root: str | os.PathLike, step: int, tensor: str, pos: int = 0, at: int | None = None) -> str:
    """Flip one bit of a stored chunk of ``tensor`` (byte ``at`` of it, default its middle), in
    whichever layout the step has; the file changed."""
    path, offset, nbytes = chunk_at(root, step, tensor, pos)
    with open(path, "r+b") as f:
        f.seek(offset + (nbytes // 2 if at is None else at))
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0x10]))
    return path


def stored_chunks(root: str | os.PathLike, step: int, snapshot: bool = False) -> list[tuple[str, int]]:
    """Every stored chunk of committed ``step`` as ``(tensor, pos)`` (for ``chunk_at``), in manifest order."""
    from storage.manifest import Manifest

    marker = json.loads(open(os.path.join(root, layout.commit_key(step))).read())
    key = layout.manifest_key(step, marker["attempt"])
    m = Manifest.from_json(open(os.path.join(root, key), "rb").read(), key)
    return [(name, pos) for name, e in (m.snapshot if snapshot else m.tensors).items() for pos in range(e.n_stored)]


def chunk_named(root: str | os.PathLike, step: int, tensor: str, pos: int = 0, snapshot: bool = False) -> str:
    """How errors name that chunk (``storage.chunk_io.chunk_where``), relative to ROOT: its object, and
    for a packed chunk its bytes in the pack."""
    path, offset, nbytes = chunk_at(root, step, tensor, pos, snapshot)
    key = os.path.relpath(path, root).replace(os.sep, "/")
    return f"{key} bytes {offset}..{offset + nbytes}" if f"/{layout.PACKS}/" in key else key


def module_bits(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter (``p:NAME``) and buffer (``b:NAME``, persistent or not) of a module, copied:
    what a refit of a live module must leave bit for bit as a dense load does."""
    out = {f"p:{n}": p.detach().clone() for n, p in module.named_parameters()}
    out.update({f"b:{n}": b.detach().clone() for n, b in module.named_buffers()})
    return out


def assert_one_line(err: BaseException) -> None:
    """An error's message is one line (the contract's one-line errors)."""
    assert len(str(err).splitlines()) == 1, str(err)


def at_once(calls: Mapping[Hashable, Callable[[], object]], timeout: float) -> tuple[dict, float]:
    """Run every call in its own thread, released together (a barrier); returns key -> its result
    or the exception it raised, and the seconds until all were done (a thread still running after
    ``timeout`` fails the test)."""
    barrier, results = threading.Barrier(len(calls)), {}

    def run(key, call):
        barrier.wait()
        try:
            results[key] = call()
        except Exception as e:  # noqa: BLE001 - handed to the caller
            results[key] = e

    threads = [threading.Thread(target=run, args=kv) for kv in calls.items()]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), f"still running after {timeout:.0f} s"
    return results, time.monotonic() - t0
