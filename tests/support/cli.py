"""Run ``dcr`` as users do (a subprocess, no orchestrator) and a small published bucket to run it on."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch

from tests.support.helpers import write_safetensors

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository


def dcr(*args, env=None, check=None, timeout: float | None = 300):
    """``dcr ARGS`` in a fresh process; ``check``: the exit code it must end with."""
    e = {**os.environ, "DCR_ORCHESTRATOR": "none", **(env or {})}
    out = subprocess.run([sys.executable, "-m", "flows.cli", *map(str, args)], capture_output=True, text=True,
                         cwd=REPO, env=e, timeout=timeout)
    if check is not None:
        assert out.returncode == check, (out.returncode, out.stdout, out.stderr)
    return out


_LAUNCH = (
    "import importlib, os, sys\n"
    "for m in filter(None, os.environ.get('PRELOAD', '').split(',')): importlib.import_module(m)\n"
    "from flows.cli import main\n"
    "try:\n"
    "    rc = main(sys.argv[1:])\n"
    "finally:\n"
    "    hwm = open('/proc/self/status').read().split('VmHWM:')[1].split()[0]\n"
    "    print('VmHWM', hwm, file=sys.stderr)\n"
    "sys.exit(rc)\n"
)


def dcr_peak_rss(*args, env=None, timeout: float = 300) -> tuple[int, str, int]:
    """``dcr ARGS`` in a fresh process: (exit code, stderr, peak resident bytes), the peak read from
    the process's own /proc status (the rusage of a child would include what the forking test
    process held before exec). ``PRELOAD`` in ``env``: modules to import first (an idle baseline)."""
    e = {**os.environ, "DCR_ORCHESTRATOR": "none", **(env or {})}
    out = subprocess.run([sys.executable, "-c", _LAUNCH, *map(str, args)], cwd=REPO, env=e,
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=timeout)
    hwm = [x for x in out.stderr.splitlines() if x.startswith("VmHWM")]
    err = "\n".join(x for x in out.stderr.splitlines() if not x.startswith("VmHWM"))
    return out.returncode, err, int(hwm[-1].split()[1]) * 1024 if hwm else -1


def small_checkpoint(seed: int, rows: int = 300) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(rows, 64, generator=g).bfloat16(),
        "b": torch.randn(7, generator=g),
        "step": torch.tensor(seed, dtype=torch.int64),
    }


def evolve(ck, seed):
    out = {n: t.clone() for n, t in ck.items()}
    out["w"].view(-1).view(torch.int16)[seed::97] ^= 1
    out["step"] += 1
    return out


def publish_chain(d: Path, steps: int = 4, env=None) -> list[dict[str, torch.Tensor]]:
    """Publish ``steps`` small steps into ``d / "bucket"`` with ``dcr publish``; the checkpoints."""
    cks = [small_checkpoint(0)]
    for s in range(1, steps):
        cks.append(evolve(cks[-1], s))
    for s, ck in enumerate(cks):
        p = d / f"c{s}.safetensors"
        write_safetensors(p, ck)
        dcr("publish", d / "bucket", p, "--step", s, "--chunk-bytes", 4096, env=env, check=0)
    return cks


def copy_tree(made: Path, tmp_path: Path) -> Path:
    """A private copy of a bucket (and its neighbours) published once per module."""
    shutil.copytree(made, tmp_path, dirs_exist_ok=True, symlinks=True)
    return tmp_path
