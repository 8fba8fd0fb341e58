"""Publisher and receiver memory is bounded by one tensor plus the transfer window, not the model."""

from __future__ import annotations

import os

import pytest
import torch

from tests.support.cli import dcr_peak_rss
from tests.support.helpers import write_safetensors

MiB = 1 << 20


def _peak_rss(args, env) -> int:
    code, err, peak = dcr_peak_rss(*args, env=env)
    assert code == 0, err
    return peak


@pytest.mark.slow  # about 16 s: the slow suite (make test-slow)
def test_peak_memory_of_publish_and_receive_stays_far_below_the_model_size(tmp_path):
    n_tensors, rows, cols = 16, 2048, 4096  # 16 tensors of 16 MiB: a 256 MiB BF16 model
    g = torch.Generator().manual_seed(0)
    model = {f"layers.{i}.weight": torch.randn(rows, cols, generator=g).bfloat16() for i in range(n_tensors)}
    model_bytes = sum(t.numel() * 2 for t in model.values())
    tensor_bytes = rows * cols * 2
    c0, c1 = tmp_path / "c0.safetensors", tmp_path / "c1.safetensors"
    write_safetensors(c0, model)
    for t in model.values():
        t.view(-1).view(torch.int16)[::50] ^= 1  # 2% of the weights change
    write_safetensors(c1, model)
    del model
    root = tmp_path / "bucket"
    env = {**os.environ, "DCR_ORCHESTRATOR": "none", "DCR_CACHE_DIR": str(tmp_path / "cache")}
    io = ["--io-workers", "4"]
    # Idle: the interpreter and what each command imports (publish: torch; receive: no torch).
    root.mkdir()  # an empty ROOT: `ls --allow-empty` (below) only measures what the command imports
    idle_publish = _peak_rss(["ls", root, "--allow-empty"], {**env, "PRELOAD": "flows.cli.publish"})
    idle_receive = _peak_rss(["ls", root, "--allow-empty"], {**env, "PRELOAD": "flows.cli.receive"})
    publish_key = _peak_rss(["publish", root, c0, "--step", 0, "--chunk-bytes", MiB, *io], env)
    publish_delta = _peak_rss(["publish", root, c1, "--step", 1, "--chunk-bytes", MiB, *io], env)
    receive = _peak_rss(["receive", root, "--receiver", "r", "--state", tmp_path / "s.safetensors", *io], env)
    back = _peak_rss(["receive", root, "--receiver", "r", "--state", tmp_path / "s.safetensors", "--step", 0, *io], env)
    verify = _peak_rss(["verify", root, "--deep", *io], env)  # rebuilds step 0, replays step 1
    # one source tensor + one baseline tensor + a copy for XOR + the window of 1 MiB chunks + slack
    bound = 4 * tensor_bytes + 32 * MiB
    extra = {"publish_keyframe": publish_key - idle_publish, "publish_delta": publish_delta - idle_publish,
             "receive": receive - idle_receive, "receive_back": back - idle_receive,
             "verify_deep": verify - idle_receive}
    print({k: f"{v / MiB:.0f} MiB" for k, v in extra.items()},
          f"idle {idle_publish / MiB:.0f} / {idle_receive / MiB:.0f} MiB, model {model_bytes / MiB:.0f} MiB")
    for what, v in extra.items():
        assert v < bound, f"{what}: {v / MiB:.0f} MiB over idle, bound {bound / MiB:.0f} MiB (model {model_bytes / MiB:.0f} MiB)"
    assert bound < model_bytes / 2
