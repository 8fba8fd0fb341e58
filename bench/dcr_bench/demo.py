"""A self-contained demo: train a small model, publish each step as a delta, refit two receivers bit-exactly."""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from dataclasses import asdict

import torch
from safetensors.torch import load_file

from dcr_bench.models.demo_lm import DEFAULT_LR, DemoLM, ModelConfig, canonical, train_step
from dcr_core.errors import DCRError
from dcr_core.text import plural
from flows import PublishOptions, run_materialize, run_publish, run_receive
from flows.cli import Parser
from flows.cli.values import Number

RECEIVERS = ("rollout-a", "rollout-b")
MARKER = ".dcr-demo"  # marks a workdir the demo created, so a rerun may wipe it


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
    mean = lambda key: sum(r[key] for r in deltas) / len(deltas)
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
        f"\n{plural(summary['steps'], 'delta')} after the keyframe; mean change rate {100 * summary['mean_change_rate']:.3f}%\n"
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


def build_parser() -> Parser:
    p = Parser(
        prog="dcr demo",
        description="Train a small model on CPU, publish each step as a delta and refit two receivers, "
        "checking every refit bit for bit against the trainer and a dense refit. The workdir of an earlier "
        "demo run is wiped at start.",
    )
    p.add_argument(
        "--workdir", default="dcr-demo", help="state files, cache and the default root (default ./dcr-demo)"
    )
    p.add_argument("--root", help="ROOT to publish to; must hold no steps (default WORKDIR/bucket)")
    p.add_argument("--steps", type=Number(int, 1), default=8, help="training steps, each published as a delta (default 8)")
    p.add_argument("--lr", type=Number(float, 0, lo_open=True), default=DEFAULT_LR, help=f"AdamW learning rate (default {DEFAULT_LR:g})")
    p.add_argument("--json", metavar="PATH", help="write the summary as JSON to PATH")
    p.add_argument("--fresh", action="store_true", help="delete WORKDIR even if no earlier demo created it")
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
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
