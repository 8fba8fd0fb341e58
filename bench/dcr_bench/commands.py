"""Commands as a user runs them: start-up of the read-only commands, and ``dcr publish`` of a BF16
checkpoint file against ``zstd -1 -T1`` over the same file, process start-up included.

- *Start-up*: ``dcr ls ROOT``, ``dcr verify ROOT --step 1`` and ``dcr receive`` of a state file
  already at the latest step, on a small local ROOT (a 1 MB checkpoint, a keyframe and a delta):
  best of ``repeats`` wall times of fresh processes.
- *Publish*: a ``size``-byte BF16 checkpoint (one tensor per 4096-wide row block of 32 MiB at most,
  weights ~N(0, 0.02)) and a copy with ``rate`` of its elements moved by one unit; the keyframe is
  published first, then the two files alternately as deltas (steps 1, 2, ...: each a delta of
  ``rate`` against the one before, the publisher's baseline cache warm as in a training loop). Best
  of ``repeats`` for ``dcr publish`` and for ``zstd -q -1 -T1`` compressing the new file.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import numpy as np

from dcr_core.dtypes import TensorInfo
from storage.local.safetensors import StreamingSafetensorsWriter

ROW = 4096


def _dcr_argv() -> list[str]:
    exe = os.path.join(os.path.dirname(sys.executable), "dcr")
    return [exe] if os.access(exe, os.X_OK) else [sys.executable, "-m", "flows.cli"]


def _timed(argv: list[str], env: dict) -> float:
    t0 = time.perf_counter()
    out = subprocess.run(argv, env=env, capture_output=True, text=True)
    elapsed = time.perf_counter() - t0
    if out.returncode:
        raise RuntimeError(f"{' '.join(argv[:3])} failed: {out.stderr.strip()[-600:]}")
    return elapsed


def _best(argv: list[str], env: dict, repeats: int) -> float:
    return min(_timed(argv, env) for _ in range(repeats))


def _checkpoints(size: int, rate: float, seed: int, work: str) -> tuple[str, str]:
    """Two BF16 safetensors files of ``size`` bytes: old and new (``rate`` of elements one unit apart)."""
    rng = np.random.default_rng(seed)
    n = size // 2
    w = (rng.standard_normal(n, dtype=np.float32) * 0.02).view(np.uint32)
    old = (w >> 16).astype(np.uint16)
    new = old.copy()
    pos = rng.choice(n, size=int(rate * n), replace=False)
    new[pos] = np.where(rng.random(pos.size) < 0.5, new[pos] + 1, new[pos] - 1).astype(np.uint16)
    rows = max(1, (32 << 20) // (2 * ROW))
    paths = []
    for tag, bits in (("old", old), ("new", new)):
        tensors, at, i = {}, 0, 0
        while at < n:
            take = min(rows * ROW, n - at)
            shape = (take // ROW, ROW) if take % ROW == 0 else (take,)
            tensors[f"layer.{i:03d}.weight"] = ("BF16", shape, bits[at: at + take])
            at, i = at + take, i + 1
        path = os.path.join(work, f"cmd-{tag}.safetensors")
        w = StreamingSafetensorsWriter(path, [TensorInfo(k, d, s) for k, (d, s, _) in tensors.items()], durable=False)
        for k, (_, _, b) in tensors.items():
            w.write(k, b)
        w.commit()
        paths.append(path)
    return paths[0], paths[1]


def _startup(dcr: list[str], env: dict, work: str, rate: float, seed: int, repeats: int) -> dict:
    small = os.path.join(work, "small")
    os.makedirs(small, exist_ok=True)
    old, new = _checkpoints(10**6, rate, seed, small)
    root = os.path.join(small, "root")
    common = ["--orchestrator", "none", "-q"]
    for step, path in enumerate((old, new)):
        _timed([*dcr, "publish", root, path, "--step", str(step), *common], env)
    state = os.path.join(small, "state.safetensors")
    _timed([*dcr, "receive", root, "--receiver", "bench", "--state", state, *common], env)
    return {
        "ls": _best([*dcr, "ls", root], env, repeats),
        "verify": _best([*dcr, "verify", root, "--step", "1", "-q"], env, repeats),
        "receive": _best([*dcr, "receive", root, "--receiver", "bench", "--state", state, *common], env, repeats),
    }


def measure(work: str, quick: bool = False, rate: float = 0.03, seed: int = 0, repeats: int = 3) -> dict:
    size = (20 if quick else 200) * 10**6
    work = os.path.join(work, "commands")
    os.makedirs(work, exist_ok=True)
    env = {**os.environ, "DCR_CACHE_DIR": os.path.join(work, "cache")}
    dcr = _dcr_argv()
    root = os.path.join(work, "root")
    old, new = _checkpoints(size, rate, seed, work)
    common = ["--orchestrator", "none", "-q"]
    _timed([*dcr, "publish", root, old, "--step", "0", *common], env)
    publish = []
    for k in range(repeats):
        src = new if k % 2 == 0 else old
        publish.append(_timed([*dcr, "publish", root, src, "--step", str(k + 1), *common], env))
    startup = _startup(dcr, env, work, rate, seed, repeats)
    zstd_bin = shutil.which("zstd")
    zstd = None
    if zstd_bin:
        out = os.path.join(work, "new.zst")
        zstd = _best([zstd_bin, "-q", "-1", "-T1", "-f", new, "-o", out], env, repeats)
        os.remove(out)
    shutil.rmtree(work, ignore_errors=True)
    best = min(publish)
    return {"checkpoint_bytes": size, "change_rate": rate, "repeats": repeats, "publish_s": publish,
            "publish_best_s": best, "zstd_1_T1_s": zstd, "publish_over_zstd": best / zstd if zstd else None,
            "startup_s": startup, "dcr": " ".join(os.path.basename(a) for a in dcr)}


def markdown(res: dict) -> list[str]:
    z = res["zstd_1_T1_s"]
    lines = [
        "\n## Commands (fresh processes, best of {})\n".format(res["repeats"]),
        "| command | seconds |",
        "|---|---:|",
        *(f"| `dcr {k}` ({what}) | {res['startup_s'][k]:.3f} |" for k, what in (
            ("ls", "1 MB local ROOT"), ("verify", "of its delta"), ("receive", "of a state file already at the step"))),
        (f"| `dcr publish` of a {res['checkpoint_bytes'] / 1e6:.0f} MB BF16 checkpoint, "
         f"{100 * res['change_rate']:g}% changed (delta, warm baseline cache) | {res['publish_best_s']:.3f} |"),
        f"| `zstd -q -1 -T1` over the same file | {'n/a' if z is None else f'{z:.3f}'} |",
    ]
    if res["publish_over_zstd"] is not None:
        lines.append(f"\n`dcr publish` / `zstd -1 -T1`: {res['publish_over_zstd']:.2f}x.")
    return lines
