"""Run ``dcr`` as users do, and a small published bucket to run it on.

``dcr(...)`` calls the command line's ``main(argv)`` in this process, as a fresh process would run
it: its own stdout and stderr captured, the environment it was given, no filesystem or ROOT
instances left from earlier calls, and a warning printed the way an unconfigured process prints it
(the message alone, on stderr). ``dcr_process(...)`` runs it in a new interpreter; keep that for
what only a process shows: kill -9, signals, imports, memory, processes racing one another.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import fsspec
import torch

from dcr_core import events
from flows.cli import PrintableRecords
from tests.support.helpers import write_safetensors

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository


def dcr_process(*args, env=None, check=None, timeout: float | None = 300):
    """``dcr ARGS`` in a fresh process; ``check``: the exit code it must end with."""
    e = {**os.environ, "DCR_ORCHESTRATOR": "none", **(env or {})}
    out = subprocess.run([sys.executable, "-m", "flows.cli", *map(str, args)], capture_output=True, text=True,
                         cwd=REPO, env=e, timeout=timeout)
    if check is not None:
        assert out.returncode == check, (out.returncode, out.stdout, out.stderr)
    return out


class _Stream(io.StringIO):
    """A captured stdout/stderr: not a terminal (as under a pipe), no file descriptor."""

    def isatty(self) -> bool:
        return False


def _forget_open_stores() -> None:
    """What a new process would not have: fsspec filesystem instances (an S3 client keeps the
    endpoint it was made with), the ROOTs opened by earlier commands, and what storage remembers
    per process."""
    from storage import catalog, run_identity
    from storage import root as root_mod

    for cls in set(fsspec.registry.values()) | {type(fsspec.filesystem("file"))}:
        cls.clear_instance_cache()
    with root_mod._ROOTS_LOCK:
        root_mod._ROOTS.clear()
    run_identity._seen.clear()  # the ROOT's run, manifests read, warnings given once per process
    with catalog._MANIFESTS_LOCK:
        catalog._MANIFESTS.clear()
    catalog._WARNED_UNCHECKED.clear()


@contextlib.contextmanager
def _as_a_process(env: dict, out: io.StringIO, err: io.StringIO, cwd=None):
    failpoints = env.get("DCR_FAILPOINTS")
    if failpoints and any(a in failpoints for a in ("=pause", "=exit")):
        raise ValueError("pause and exit failpoints end or stop the process: use dcr_process or kill_at")
    root = logging.getLogger()
    # Python's last-resort handler: an unconfigured process prints a warning as its message alone
    handler = logging.StreamHandler(err)
    handler.setLevel(logging.WARNING)
    handler.addFilter(PrintableRecords())  # as the command line sets up the last-resort handler
    saved_handlers, saved_level = root.handlers[:], root.level
    old_env, old_cwd = dict(os.environ), os.getcwd()
    os.environ.update({k: str(v) for k, v in env.items()})
    if cwd is not None:
        os.chdir(cwd)
    root.handlers[:] = [handler]
    root.setLevel(logging.WARNING)
    _forget_open_stores()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), \
                (events.failpoints(failpoints) if failpoints else contextlib.nullcontext()):
            yield
    finally:
        root.handlers[:] = saved_handlers
        root.setLevel(saved_level)
        os.environ.clear()
        os.environ.update(old_env)
        os.chdir(old_cwd)
        _forget_open_stores()


def dcr(*args, env=None, check=None, timeout: float | None = None, cwd=None):
    """``dcr ARGS`` run in this process as a fresh process runs it (see the module doc): a
    ``CompletedProcess`` with its exit code and what it printed; ``check``: the exit code it must
    end with; ``cwd``: the directory it runs in. ``timeout`` is accepted for symmetry with
    ``dcr_process`` and not enforced."""
    from flows.cli import main

    argv = [str(a) for a in args]
    out, err = _Stream(), _Stream()
    with _as_a_process({"DCR_ORCHESTRATOR": "none", **(env or {})}, out, err, cwd):
        try:
            rc = main(argv)
        except SystemExit as e:  # argparse: usage errors and --help
            rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            if not isinstance(e.code, int | None):
                print(e.code, file=err)
    result = subprocess.CompletedProcess(["dcr", *argv], rc, out.getvalue(), err.getvalue())
    if check is not None:
        assert result.returncode == check, (result.returncode, result.stdout, result.stderr)
    return result


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


def one_line_error(out, code: int, *parts: str) -> str:
    """The one stderr line of a command that exited with ``code``, holding every one of ``parts``."""
    lines = out.stderr.strip().splitlines()
    assert out.returncode == code and len(lines) == 1, (out.returncode, out.stdout, out.stderr)
    for part in parts:
        assert part in lines[0], lines[0]
    return lines[0]


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
