"""``SafetensorsCheckpoint.mapped_bits``: one read-only map per file, of the file as it was opened.

The engine's pause reads every reloaded tensor through these maps (``flows.receive.engine_apply``),
so they must give exactly the bits ``bits`` reads, for every dtype and size, keep reading the file
that was validated when its path is replaced meanwhile, outlive ``close`` while viewed, and be
unmapped once nothing views them (the pages a receive or a publish touched do not stay in it)."""

import gc
import json
import os
import struct

import numpy as np
import pytest

from dcr_core.dtypes import DTYPES
from storage.local.safetensors import SafetensorsCheckpoint


def _tensors(seed: int) -> dict[str, tuple[str, tuple, np.ndarray]]:
    """name -> (dtype, shape, raw bits) for every supported dtype, at sizes that are no multiple of
    anything, plus a 0-d and an empty tensor; the float ones hold NaNs with distinct payloads, signed
    zeros, infinities and subnormals."""
    g = np.random.default_rng(seed)
    special = {16: [0x7FC1, 0x7F81, 0xFFC3, 0x8000, 0x0000, 0x0001, 0x7F80, 0xFF80],  # BF16 (F16: other NaNs)
               32: [0x7FC00001, 0x7FA00001, 0xFFC00003, 0x80000000, 0, 1, 0x7F800000, 0xFF800000],
               64: [0x7FF8000000000001, 0xFFF0000000000003, 1 << 63, 0, 1, 0x7FF0000000000000]}
    out = {}
    for k, (name, d) in enumerate(DTYPES.items()):
        n = 97 + 13 * k
        bits = g.integers(0, np.iinfo(d.storage).max, n, dtype=d.storage, endpoint=True)
        head = special.get(d.bits, [0x7F, 0xFF, 0x80, 0x00, 0x01])
        bits[: len(head)] = np.array(head, dtype=np.uint64).astype(d.storage)
        out[f"t.{name}"] = (name, (n,), bits)
    out["t.scalar"] = ("F64", (), np.array([1 << 63], np.uint64))  # 0-d: -0.0
    out["t.empty"] = ("BF16", (0, 3), np.empty(0, np.uint16))
    return out


def _write(path: str, tensors: dict) -> None:
    header, blobs, at = {}, [], 0
    for name, (dtype, shape, bits) in tensors.items():
        raw = bits.tobytes()
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [at, at + len(raw)]}
        blobs.append(raw)
        at += len(raw)
    text = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def test_maps_give_the_bits_and_keep_the_file_that_was_opened(tmp_path):
    path = str(tmp_path / "model.safetensors")
    first, second = _tensors(1), _tensors(2)
    _write(path, first)
    ck = SafetensorsCheckpoint(path)
    mapped = {n: ck.mapped_bits(n) for n in first}
    for name, (_, _, bits) in first.items():
        assert mapped[name].tobytes() == bits.tobytes() == ck.bits(name).tobytes(), name
        assert not mapped[name].flags.writeable or not bits.size, name  # (an empty one maps nothing)
    with pytest.raises(ValueError):
        mapped["t.BF16"][0] = 1

    _write(path + ".tmp", second)  # the path replaced, as a publisher's cache is
    os.replace(path + ".tmp", path)
    again = {n: ck.mapped_bits(n) for n in first}  # still the file this checkpoint validated
    ck.close()
    for name, (_, _, bits) in first.items():
        assert again[name].tobytes() == mapped[name].tobytes() == bits.tobytes(), name
    with SafetensorsCheckpoint(path) as other:
        assert other.mapped_bits("t.BF16").tobytes() == second["t.BF16"][2].tobytes()


def _maps_of(path: str) -> int:
    target = os.path.realpath(path)
    with open("/proc/self/maps") as f:
        return sum(1 for line in f if line.rstrip().endswith(target))


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="reads /proc/self/maps (Linux)")
def test_a_map_is_gone_once_nothing_views_it(tmp_path):
    path = str(tmp_path / "model.safetensors")
    _write(path, _tensors(3))
    with SafetensorsCheckpoint(path) as ck:
        held = [ck.mapped_bits(n) for n in ck.infos]
        viewed = held[0][1:]  # a view keeps its map
        assert _maps_of(path) >= 1
        del held
        gc.collect()
        assert _maps_of(path) == 1
        del viewed
        gc.collect()
        assert _maps_of(path) == 0
