"""The dcr-zarr-codec package alone: a virtualenv with only it (and the numpy, numcodecs and zarr it
pulls) reads DCR's sparse delta arrays with stock zarr, and nothing of DCR, torch or Prefect is there."""

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
out = {}
for store, arrays in json.loads(sys.argv[1]).items():
    group = zarr.open_group(store, mode="r")
    for name in arrays:
        a = group[name]
        out[store + "/" + name] = [a.metadata.codecs[-1].to_dict()["name"], hashlib.sha256(a[...].tobytes()).hexdigest()]
missing = []
for mod in ("torch", "prefect", "dcr_core", "storage", "flows", "s3fs"):
    try:
        __import__(mod)
    except ImportError:
        missing.append(mod)
print(json.dumps({"arrays": out, "missing": missing}))
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
    run_publish(root, new, 1, options=PublishOptions(chunk_bytes=4096))
    manifest = json.loads(next((tmp_path / "bucket" / layout.attempts_dir(1)).rglob("manifest.json")).read_text())
    assert manifest["codec"]["name"] == "dcr-sparse"
    store = str(next((tmp_path / "bucket" / layout.attempts_dir(1)).glob("*/data.zarr")))
    expected = {}
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
    out = subprocess.run([py, "-c", READ, json.dumps(arrays)], env=clean, capture_output=True, text=True,
                         timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout)
    assert got["arrays"] == expected
    assert set(got["missing"]) == {"torch", "prefect", "dcr_core", "storage", "flows", "s3fs"}
