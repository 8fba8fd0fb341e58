"""The dcr-zarr-codec package alone: a virtualenv with only it (and the numpy, numcodecs, zarr and
fsspec it pulls) reads DCR's sparse delta arrays with stock zarr, and any tensor of a step, packed or
not, with its one call; nothing of DCR, torch or Prefect is there."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import venv

import pytest
import torch
import zarr

from flows import run_publish
from flows.options import PublishOptions
from storage import layout
from tests.support.cli import REPO
from tests.support.helpers import nasty_tensor

pytestmark = pytest.mark.slow

READ = r"""
import hashlib, json, sys
import zarr
import dcr_zarr_codec
args = json.loads(sys.argv[1])
out = {}
for store, arrays in args["stores"].items():
    group = zarr.open_group(store, mode="r")
    for name in arrays:
        a = group[name]
        out[store + "/" + name] = [a.metadata.codecs[-1].to_dict()["name"], hashlib.sha256(a[...].tobytes()).hexdigest()]
tensors = {f"{step}/{name}": hashlib.sha256(dcr_zarr_codec.open_tensor(args["root"], step, name)[...].tobytes()).hexdigest()
           for step in (1, 2) for name in args["tensors"]}
missing = []
for mod in ("torch", "prefect", "dcr_core", "storage", "flows", "s3fs"):
    try:
        __import__(mod)
    except ImportError:
        missing.append(mod)
print(json.dumps({"arrays": out, "tensors": tensors, "missing": missing}))
"""


def test_stock_zarr_reads_delta_arrays_with_only_the_codec_package(tmp_path):
    g = torch.Generator().manual_seed(3)
    old = {"w": nasty_tensor("BF16", (257, 33), seed=1), "e": nasty_tensor("F32", (1000,), seed=2),
           "s": torch.tensor(1.5, dtype=torch.float16)}
    new = {n: t.clone() for n, t in old.items()}
    flat = new["w"].view(-1).view(torch.int16)
    flat[torch.randperm(flat.numel(), generator=g)[:200]] ^= 0x0101
    new["e"].view(torch.int32)[::7] ^= 1 << 31  # sign flips: +0.0 <-> -0.0 among them
    root = str(tmp_path / "bucket")
    run_publish(root, old, 0)
    run_publish(root, new, 1, options=PublishOptions(chunk_bytes=4096, pack_bytes=0))  # a Zarr store stock zarr opens
    manifest = json.loads(next((tmp_path / "bucket" / layout.attempts_dir(1)).rglob("manifest.json")).read_text())
    assert manifest["codec"]["name"] == "dcr.sparse"
    store = str(next((tmp_path / "bucket" / layout.attempts_dir(1)).glob("*/data.zarr")))
    newer = {n: t.clone() for n, t in new.items()}
    newer["w"].view(-1).view(torch.int16)[::5] ^= 0x0001
    run_publish(root, newer, 2, options=PublishOptions(chunk_bytes=4096, pack_bytes=256))
    packed = json.loads(next((tmp_path / "bucket" / layout.attempts_dir(2)).rglob("manifest.json")).read_text())
    assert len(packed["packs"]) > 1  # the packed layout: no zarr.json, chunks inside pack objects
    expected, tensors = {}, {}
    for name in ("w", "e", "s"):
        for step, (x, y) in ((1, (old, new)), (2, (new, newer))):
            xor = x[name].reshape(-1).view(torch.uint8).numpy() ^ y[name].reshape(-1).view(torch.uint8).numpy()
            tensors[f"{step}/{name}"] = hashlib.sha256(xor.tobytes()).hexdigest()
    for name in ("w", "e"):
        a = zarr.open_group(store, mode="r")[manifest["tensors"][name]["array"]]
        xor = (old[name].view(-1).view(torch.uint8).numpy() ^ new[name].view(-1).view(torch.uint8).numpy())
        assert a[...].tobytes() == xor.tobytes()  # here, in DCR's environment
        expected[f"{store}/{manifest['tensors'][name]['array']}"] = ["dcr.sparse", hashlib.sha256(xor.tobytes()).hexdigest()]

    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    py = str(env_dir / "bin" / "python")
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    install = subprocess.run([py, "-m", "pip", "install", "-q", os.path.join(REPO, "codec")], env=clean,
                             capture_output=True, text=True, timeout=600)
    assert install.returncode == 0, install.stderr[-3000:]
    arrays = {store: [manifest["tensors"][n]["array"] for n in ("w", "e")]}
    args = {"stores": arrays, "root": root, "tensors": ["w", "e", "s"]}
    out = subprocess.run([py, "-c", READ, json.dumps(args)], env=clean, capture_output=True, text=True,
                         timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout)
    assert got["arrays"] == expected
    assert got["tensors"] == tensors
    assert set(got["missing"]) == {"torch", "prefect", "dcr_core", "storage", "flows", "s3fs"}
