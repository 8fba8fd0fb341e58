"""A self-contained demo: train a small model, publish each step as a delta, refit two receivers bit-exactly."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

from dcr_core.errors import DCRError
from flows.options import PublishOptions
from flows.pipeline import run_materialize, run_publish, run_receive

# At this rate AdamW's first steps move ~1-3% of the BF16 weights (init std 0.02) per step,
# the order of magnitude seen when refitting RL policies.
DEFAULT_LR = 1e-6
RECEIVERS = ("rollout-a", "rollout-b")
MARKER = ".dcr-demo"  # marks a workdir the demo created, so a rerun may wipe it


@dataclass(frozen=True)
class ModelConfig:
    vocab: int = 8192
    hidden: int = 512
    layers: int = 4
    heads: int = 8
    kv_heads: int = 2  # grouped-query attention: k/v projections are narrower than q
    intermediate: int = 1376
    seq_len: int = 64
    batch: int = 8


class RMSNorm(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class Rotary(nn.Module):
    def __init__(self, head_dim: int):
        super().__init__()
        # A persistent buffer: it is part of the checkpoint but never trained.
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ang = torch.outer(torch.arange(x.shape[-2], dtype=torch.float32), self.inv_freq)
        cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
        x1, x2 = x.chunk(2, -1)
        return x * cos + torch.cat([-x2, x1], -1) * sin


class Attention(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.c, hd = c, c.hidden // c.heads
        self.q_proj = nn.Linear(c.hidden, c.heads * hd, bias=False)
        self.k_proj = nn.Linear(c.hidden, c.kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(c.hidden, c.kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(c.heads * hd, c.hidden, bias=False)

    def forward(self, x: torch.Tensor, rope: Rotary) -> torch.Tensor:
        b, t, _ = x.shape
        c, rep = self.c, self.c.heads // self.c.kv_heads
        q = rope(self.q_proj(x).view(b, t, c.heads, -1).transpose(1, 2))
        k = rope(self.k_proj(x).view(b, t, c.kv_heads, -1).transpose(1, 2)).repeat_interleave(rep, 1)
        v = self.v_proj(x).view(b, t, c.kv_heads, -1).transpose(1, 2).repeat_interleave(rep, 1)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(o.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden, c.intermediate, bias=False)
        self.up_proj = nn.Linear(c.hidden, c.intermediate, bias=False)
        self.down_proj = nn.Linear(c.intermediate, c.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.input_layernorm, self.post_attention_layernorm = RMSNorm(c.hidden), RMSNorm(c.hidden)
        self.self_attn, self.mlp = Attention(c), MLP(c)

    def forward(self, x: torch.Tensor, rope: Rotary) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope)
        return x + self.mlp(self.post_attention_layernorm(x))


class Body(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab, c.hidden)
        self.layers = nn.ModuleList(Layer(c) for _ in range(c.layers))
        self.norm = RMSNorm(c.hidden)
        self.rotary_emb = Rotary(c.hidden // c.heads)


class DemoLM(nn.Module):
    """Module names follow Hugging Face Llama-style checkpoints (model.layers.N.self_attn.q_proj...)."""

    def __init__(self, c: ModelConfig):
        super().__init__()
        self.model = Body(c)
        self.lm_head = nn.Linear(c.hidden, c.vocab, bias=False)
        for p in self.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.model.embed_tokens(ids)
        for layer in self.model.layers:
            h = layer(h, self.model.rotary_emb)
        return self.lm_head(self.model.norm(h))


def canonical(model: nn.Module) -> dict[str, torch.Tensor]:
    """The published checkpoint: BF16 casts of the FP32 master weights, buffers as they are."""
    params = {n for n, _ in model.named_parameters()}
    return {
        n: (t.detach().to(torch.bfloat16) if n in params else t.detach()).contiguous()
        for n, t in model.state_dict().items()
    }


def train_step(model: nn.Module, opt: torch.optim.Optimizer, c: ModelConfig, gen: torch.Generator) -> float:
    ids = torch.randint(0, c.vocab, (c.batch, c.seq_len + 1), generator=gen)
    loss = F.cross_entropy(model(ids[:, :-1]).reshape(-1, c.vocab), ids[:, 1:].reshape(-1))
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return loss.item()


def mismatch(expected: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> str | None:
    """None when ``got`` equals ``expected`` bit for bit, else a message naming the first difference."""
    if set(expected) != set(got):
        missing, extra = sorted(set(expected) - set(got)), sorted(set(got) - set(expected))
        return f"tensor names differ: missing {missing}, extra {extra}"
    for name, e in expected.items():
        g = got[name]
        if g.dtype != e.dtype or g.shape != e.shape:
            return f"{name}: {g.dtype} {tuple(g.shape)} != expected {e.dtype} {tuple(e.shape)}"
        if not torch.equal(g.contiguous().reshape(-1).view(torch.uint8), e.reshape(-1).view(torch.uint8)):
            return f"{name}: bytes differ from the trainer's canonical tensor"
    return None


def _mib(n: float) -> str:
    return f"{n / (1 << 20):.2f}MiB"


HEADER = (
    f"{'step':>4} {'kind':<8} {'chg%':>7} {'tensors':>9} {'stored':>9} {'full':>9} {'ratio%':>7} "
    f"{'pub s':>6} {'recv s':>6} {'exact':>5}"
)


def _row(r: dict) -> str:
    return (
        f"{r['step']:>4} {r['kind']:<8} {100 * r['change_rate']:>7.3f} "
        f"{r['tensors_changed']:>4}/{r['tensors']:<4} {_mib(r['bytes_stored']):>9} {_mib(r['bytes_full']):>9} "
        f"{100 * r['bytes_stored'] / r['bytes_full']:>7.2f} {r['publish_s']:>6.2f} {r['receive_s']:>6.2f} "
        f"{'yes' if r['exact'] else 'NO':>5}"
    )


def _refit_and_check(root: str, workdir: str, step: int, expected: dict[str, torch.Tensor]) -> tuple[float, str | None]:
    """Refit every receiver to ``step``, then compare them and a dense materialize with ``expected``."""
    receive_s, problem = 0.0, None
    for rid in RECEIVERS:
        state = os.path.join(workdir, f"{rid}.safetensors")
        t0 = time.perf_counter()
        run_receive(root, rid, state, step)
        receive_s = max(receive_s, time.perf_counter() - t0)  # receivers run side by side in practice
        problem = problem or _prefixed(rid, mismatch(expected, load_file(state)))
    dense = os.path.join(workdir, "dense.safetensors")
    run_materialize(root, step, dense)
    problem = problem or _prefixed("dense refit", mismatch(expected, load_file(dense)))
    os.remove(dense)
    return receive_s, problem


def _prefixed(who: str, msg: str | None) -> str | None:
    return f"{who}: {msg}" if msg else None


def run_demo(
    root: str,
    workdir: str,
    steps: int,
    lr: float = DEFAULT_LR,
    config: ModelConfig | None = None,
    seed: int = 0,
    verbose: bool = True,
) -> dict:
    """Publish a keyframe and ``steps`` deltas of a training run; refit and verify after each."""
    c = config or ModelConfig()
    say = (lambda s: print(s, flush=True)) if verbose else (lambda s: None)
    os.makedirs(workdir, exist_ok=True)
    opts = PublishOptions(cache_dir=os.path.join(workdir, "cache"))
    torch.manual_seed(seed)
    model = DemoLM(c)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    gen = torch.Generator().manual_seed(seed + 1)
    n_params = sum(p.numel() for p in model.parameters())
    say(f"model: {n_params / 1e6:.1f}M parameters (BF16 checkpoint), lr {lr:g}, root {root}")
    say(HEADER)
    rows, problem, wall0 = [], None, time.perf_counter()
    for step in range(steps + 1):
        loss = train_step(model, opt, c, gen) if step else None
        ckpt = canonical(model)
        t0 = time.perf_counter()
        pub = run_publish(root, ckpt, step, keyframe=(step == 0), options=opts)
        publish_s = time.perf_counter() - t0
        receive_s, problem = _refit_and_check(root, workdir, step, ckpt)
        row = {**pub.summary, "step": step, "kind": pub.kind, "loss": loss, "publish_s": publish_s,
               "receive_s": receive_s, "exact": problem is None}
        rows.append(row)
        say(_row(row))
        if problem:
            say(f"MISMATCH at step {step}: {problem}")
            break
    return _summarize(rows, problem, time.perf_counter() - wall0, root, workdir, lr, c, n_params, say)


def _summarize(rows, problem, wall_s, root, workdir, lr, c, n_params, say) -> dict:
    deltas = [r for r in rows if r["kind"] != "keyframe"] or rows
    full = rows[0]["bytes_full"]
    stored = sum(r["bytes_stored"] for r in deltas)
    mean = lambda key: sum(r[key] for r in deltas) / len(deltas)  # noqa: E731
    summary = {
        "root": root, "workdir": workdir, "lr": lr, "config": asdict(c), "parameters": n_params,
        "steps": len(rows) - 1, "exact": problem is None and all(r["exact"] for r in rows), "mismatch": problem,
        "checkpoint_bytes": full, "keyframe_bytes_stored": rows[0]["bytes_stored"],
        "delta_bytes_stored": stored, "delta_bytes_full": full * len(deltas),
        "delta_ratio": stored / (full * len(deltas)),
        "mean_change_rate": mean("change_rate"), "mean_publish_s": mean("publish_s"),
        "mean_receive_s": mean("receive_s"), "wall_s": wall_s, "rows": rows,
    }
    say(
        f"\n{summary['steps']} deltas after the keyframe; mean change rate {100 * summary['mean_change_rate']:.3f}%\n"
        f"deltas stored {_mib(stored)} vs {_mib(full)} x {len(deltas)} = {_mib(full * len(deltas))} full "
        f"({100 * summary['delta_ratio']:.2f}%)\n"
        f"mean publish {summary['mean_publish_s']:.2f}s, mean receive {summary['mean_receive_s']:.2f}s, "
        f"wall {wall_s:.1f}s; bit-exact: {'yes' if summary['exact'] else 'NO'}"
    )
    return summary


def _prepare_workdir(workdir: str, fresh: bool) -> None:
    """Wipe a workdir from an earlier demo run; refuse to wipe anything else unless --fresh."""
    if os.path.isdir(workdir) and os.listdir(workdir):
        if not (fresh or os.path.exists(os.path.join(workdir, MARKER))):
            raise SystemExit(f"{workdir}: not empty and not a demo workdir; pass --fresh to delete it or pick another")
        shutil.rmtree(workdir)
    os.makedirs(workdir, exist_ok=True)
    open(os.path.join(workdir, MARKER), "w").close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="dcr demo",
        description="Train a small model on CPU, publish each step as a delta and refit two receivers, "
        "checking every refit bit for bit against the trainer and a dense refit. The workdir of an earlier "
        "demo run is wiped at start.",
    )
    p.add_argument(
        "--workdir", default="dcr-demo", help="state files, cache and the default root (default ./dcr-demo)"
    )
    p.add_argument("--root", help="ROOT to publish to; must hold no steps (default WORKDIR/bucket)")
    p.add_argument("--steps", type=int, default=8, help="training steps, each published as a delta (default 8)")
    p.add_argument("--lr", type=float, default=DEFAULT_LR, help=f"AdamW learning rate (default {DEFAULT_LR:g})")
    p.add_argument("--json", metavar="PATH", help="write the summary as JSON to PATH")
    p.add_argument("--fresh", action="store_true", help="delete WORKDIR even if no earlier demo created it")
    a = p.parse_args(argv)
    if a.steps < 1:
        p.error("--steps must be >= 1")
    workdir = os.path.abspath(a.workdir)
    _prepare_workdir(workdir, a.fresh)
    root = a.root or os.path.join(workdir, "bucket")
    try:
        summary = run_demo(root, workdir, a.steps, lr=a.lr)
    except DCRError as e:
        print(f"dcr demo: {e}", file=sys.stderr)
        return e.exit_code
    if a.json:
        with open(a.json, "w") as f:
            json.dump(summary, f, indent=2, default=str)
    if not summary["exact"]:
        print(f"dcr demo: refit is not bit-exact: {summary['mismatch']}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
