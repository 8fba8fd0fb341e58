"""A small RL loop with DCR: a trainer takes GRPO-style steps, two vLLM servers generate the rollouts.

    make example-rl          # or: .venv-vllm/bin/python examples/rl_loop.py [--iterations N]

Each iteration: the two OpenAI-compatible vLLM servers (``--weight-transfer-config '{"backend":
"dcr"}'``) sample a group of completions per prompt, each rollout tagged with the policy version
the server reports (``/weight_info``); the trainer (a tiny Llama in BF16, this process) scores
them with a format reward (the fraction of sampled tokens whose id is below 64: about 1 in 8 for a
random policy), takes one AdamW step on the group-normalised policy gradient (GRPO's advantage,
no KL term), publishes the step to a DCR ROOT, and ``dcr fleet`` (``flows.run_fleet``) switches
both servers to it, all or nothing, before the next rollouts. Printed per iteration: the mean
reward of the rollouts, the version they came from, the fleet switch's wall time and longest
pause, and the bytes each server pulled. Every server must report the version the fleet switched
to before it samples (an assert): rollouts never mix policies.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

import torch

from dcr_bench.models.hf_tiny import checkpoint, make_model, save_config
from dcr_bench.vllm_server import Server, call
from flows import run_fleet, run_materialize, run_publish
from flows.options import PublishOptions
from storage.catalog import Catalog, utc_epoch
from storage.root import open_root

TARGET = 64  # the reward: fraction of sampled token ids below this
PROMPTS = [[1, 2, 3, 4], [100, 200, 300], [17, 9, 301, 44, 5], [450, 451]]
GROUP = 8  # completions per prompt (the GRPO group)
TOKENS = 12


def sample(url: str, prompt: list[int]) -> list[list[int]]:
    """``GROUP`` completions of ``prompt`` (token ids) at temperature 1."""
    r = call(url, "/v1/completions", {"model": call(url, "/v1/models", method="GET")["data"][0]["id"], "prompt": prompt,
                                      "n": GROUP, "max_tokens": TOKENS, "temperature": 1.0, "ignore_eos": True,
                                      "logprobs": 0, "return_tokens_as_token_ids": True})
    return [[int(t.split(":")[1]) for t in c["logprobs"]["tokens"]] for c in r["choices"]]


def reward(tokens: list[int]) -> float:
    return sum(t < TARGET for t in tokens) / len(tokens)


def grpo_step(model, opt, rollouts: list[dict]) -> float:
    """One AdamW step on -sum(advantage * log p(completion)) over the rollouts; the loss."""
    loss = torch.zeros((), dtype=torch.float32)
    for r in rollouts:
        ids = torch.tensor([r["prompt"] + r["tokens"]])
        logits = model(input_ids=ids).logits[0, len(r["prompt"]) - 1:-1].float()
        logp = torch.log_softmax(logits, -1).gather(1, torch.tensor(r["tokens"])[:, None]).sum()
        loss = loss - r["advantage"] * logp / len(rollouts)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return loss.item()


def pulled(cat: Catalog, step: int, receivers: list[str], since: int) -> list[int | None]:
    """Bytes each member pulled for ``step`` (its receiver record, written once it serves again)."""
    deadline = time.monotonic() + 30
    while True:
        recs = [cat.receiver_record(step, rid) or {} for rid in receivers]
        done = [(utc_epoch(rec.get("committed_at")) or 0) >= since for rec in recs]
        if all(done) or time.monotonic() > deadline:
            return [rec.get("bytes_pulled") if ok else None for rec, ok in zip(recs, done)]
        time.sleep(0.1)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="examples/rl_loop.py", description=__doc__.splitlines()[0])
    ap.add_argument("--iterations", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-2)
    ap.add_argument("--work", default=None, help="where the ROOT and the servers' files go (default: a temp dir)")
    args = ap.parse_args(argv)
    work = args.work or tempfile.mkdtemp(prefix="dcr-rl-")
    root = os.path.join(work, "root")
    torch.manual_seed(0)
    model = make_model("llama", "tiny", seed=1)
    save_config(model, os.path.join(work, "config"))
    opts = PublishOptions(cache_dir=os.path.join(work, "pub-cache"))
    run_publish(root, checkpoint(model), 0, options=opts)
    serve = os.path.join(work, "serve")
    shutil.copytree(os.path.join(work, "config"), serve, dirs_exist_ok=True)
    run_materialize(root, 0, os.path.join(serve, "model.safetensors"))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    servers = [Server(serve, os.path.join(work, f"server-{i}.log"), extension=False) for i in range(2)]
    rewards = []
    try:
        for s in servers:
            s.wait_ready()
        engines = [f"gen{i}={s.url}" for i, s in enumerate(servers)]
        run_fleet(root, engines, step=0, name="rl")  # enrol the servers: DCR knows their weights from here on
        cat = Catalog(open_root(root))
        print(f"{'iter':>4}  {'version':>7}  {'reward':>6}  {'loss':>8}  {'switch s':>8}  {'pause s':>7}  pulled per server")
        for it in range(1, args.iterations + 1):
            rollouts = []
            for i, prompt in enumerate(PROMPTS):
                url = servers[i % len(servers)].url
                version = call(url, "/weight_info", method="GET")["weight_version"]
                assert version == str(it - 1), (url, version)  # every rollout from the policy just published
                group = [{"prompt": prompt, "tokens": t, "version": version, "server": url} for t in sample(url, prompt)]
                rs = torch.tensor([reward(g["tokens"]) for g in group])
                adv = (rs - rs.mean()) / (rs.std() + 1e-6)
                for g, r, a in zip(group, rs.tolist(), adv.tolist()):
                    g["reward"], g["advantage"] = r, a
                rollouts += group
            mean_reward = sum(r["reward"] for r in rollouts) / len(rollouts)
            rewards.append(mean_reward)
            loss = grpo_step(model, opt, rollouts)
            run_publish(root, checkpoint(model), it, options=opts)
            since = int(time.time())
            t0 = time.perf_counter()
            r = run_fleet(root, engines, step=it, name="rl")
            switch = time.perf_counter() - t0
            got = pulled(cat, it, [m["receiver"] for m in r.members], since)
            print(f"{it:>4}  {rollouts[0]['version']:>7}  {mean_reward:>6.3f}  {loss:>8.4f}  {switch:>8.3f}  "
                  f"{max(m['pause_seconds'] for m in r.members):>7.3f}  "
                  f"{' / '.join('-' if b is None else f'{b / 1024:.1f} KiB' for b in got)}", flush=True)
    finally:
        for s in servers:
            s.stop()
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    print(f"mean reward: {rewards[0]:.3f} at version 0 -> {rewards[-1]:.3f} at version {len(rewards) - 1}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
