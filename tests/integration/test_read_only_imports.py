"""Commands that only read the bucket start fast: ``dcr ls``, ``dcr verify`` and ``dcr receive`` of a
``.safetensors`` state file run without importing torch or Prefect (torch alone takes longer to
import than the whole command); ``ls`` and ``verify`` not even pydantic (the typed options of
publish, receive and gc). Each command runs in a fresh process, as users run it, on a real ROOT."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from flows import run_publish
from tests.support.cli import REPO, evolve, small_checkpoint
from tests.support.helpers import write_safetensors
from tests.support.servers import new_root

HEAVY = ("torch", "prefect", "pydantic")
_RUN = (
    "import json, sys\n"
    "from flows.cli import main\n"
    "rc = main(sys.argv[1:])\n"
    f"print('LOADED ' + json.dumps({{'rc': rc, 'loaded': [m for m in {HEAVY!r} if m in sys.modules]}}))\n"
)


def _loaded(*argv) -> list[str]:
    """The heavy packages ``dcr ARGV`` imported, in a fresh process (it must exit 0)."""
    env = {**os.environ, "DCR_ORCHESTRATOR": "none", "DCR_PROGRESS": "0"}
    out = subprocess.run([sys.executable, "-c", _RUN, *map(str, argv)], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=120)
    last = [line for line in out.stdout.splitlines() if line.startswith("LOADED ")]
    assert out.returncode == 0 and last, (out.returncode, out.stdout, out.stderr)
    report = json.loads(last[-1].removeprefix("LOADED "))
    assert report["rc"] == 0, (out.stdout, out.stderr)
    return report["loaded"]


@pytest.mark.parametrize("backend", ["local", pytest.param("s3", marks=pytest.mark.backend)], indirect=True)
def test_read_only_commands_import_neither_torch_nor_prefect(backend, tmp_path):
    root = new_root(backend, tmp_path)
    ck = small_checkpoint(0)
    for step in range(3):
        path = tmp_path / f"c{step}.safetensors"
        write_safetensors(path, ck)
        run_publish(root, str(path), step)
        ck = evolve(ck, step + 1)
    state = tmp_path / "r0.safetensors"

    assert _loaded("ls", root) == []
    assert _loaded("verify", root) == []
    assert _loaded("receive", root, "--receiver", "r0", "--state", state, "--step", 1) == ["pydantic"]  # keyframe + delta
    assert _loaded("receive", root, "--receiver", "r0", "--state", state) == ["pydantic"]  # one delta forward
    assert _loaded("receive", root, "--receiver", "r0", "--state", state) == ["pydantic"]  # already there
