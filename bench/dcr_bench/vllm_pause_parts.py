"""What an AdamW step's pause is made of, in one process: ``python -m dcr_bench.vllm_pause_parts``.

Per model: one AdamW step (BF16) saved as a safetensors file, a vLLM engine in this process (CPU)
serving step 0, then ``--rounds`` rounds, each timing three in-place reloads of every weight from
that same file in the engine's worker (``LLM.collective_rpc``), their order rotated from one round
to the next (a reload's time depends on what ran before it):

- ``vllm``: vLLM's own ``reload_weights(weights_path=...)`` (its loader reads the file), the
  baseline of ``dcr_bench.vllm_fleet``;
- ``mapped``: the same reload fed with DCR's map of each tensor of the file
  (``SafetensorsCheckpoint.mapped_bits``, what the pause feeds it from the staged mirror);
- ``fixes``: that, through ``vllm_fixups.reload``, the rebuilt kernels then kept by reference
  (``held_digests.kernels_of``): the reload as DCR's pause runs it.

After the ``fixes`` reload, the read-back of every kernel (``held_digests.probes_of``, what the
next prepare runs in the engine's thread, and what the pause ran for the kernels it rebuilt until
it kept them by reference instead) is timed too, as ``read-back``. No server, no HTTP, no DCR
check or record: the difference between two reload columns is what that part costs. Writes
``results.json`` and ``results.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

from safetensors.torch import save_file

from dcr_bench import vllm_engine
from dcr_bench.models.hf_tiny import checkpoint, each_model, make_model, save_config, train
from dcr_core.dtypes import DTYPES
from flows.receive import held_digests, vllm_fixups
from flows.receive.engine_apply import _mapped
from storage.local.safetensors import SafetensorsCheckpoint

KINDS = ("vllm", "mapped", "fixes")


def timed_reload(worker, how: str, path: str) -> tuple[float, float | None]:
    """Seconds of one in-place reload of every weight in the file ``path``, fed as ``how`` says
    (see the module docstring), and for ``fixes`` the seconds of every kernel's read-back after
    it; runs in the engine's worker."""
    from vllm.model_executor.model_loader.reload.inplace import reload_weights

    if how == "vllm":
        t0 = time.perf_counter()
        worker.reload_weights(weights_path=os.path.dirname(path))
        return time.perf_counter() - t0, None
    cfg, model = worker.model_runner.vllm_config, worker.model_runner.model
    with SafetensorsCheckpoint(path) as ck:
        weights = ((n, _mapped(ck.mapped_bits(n), DTYPES[i.dtype], tuple(i.shape))) for n, i in sorted(ck.infos.items()))

        def run() -> None:
            with vllm_fixups.current_config(cfg):
                reload_weights(cfg, model, weights_iterator=weights, weights_path=None, is_checkpoint_format=True)

        t0 = time.perf_counter()
        if how == "mapped":
            run()
            return time.perf_counter() - t0, None
        vllm_fixups.reload(model, cfg, None, run)
        held_digests.kernels_of(model)
        t1 = time.perf_counter()
        held_digests.probes_of(model)
        return t1 - t0, time.perf_counter() - t1


def run_model(kind: str, size: str, base: str, lr: float, rounds: int) -> dict:
    model = make_model(kind, size, seed=1)
    cks = [checkpoint(model), *train(model, 1, lr=lr, seed=2)]
    files = []
    for s, ck in enumerate(cks):
        d = os.path.join(base, f"step-{s}")
        save_config(model, d)
        files.append(os.path.join(d, "model.safetensors"))
        save_file(ck, files[-1])
    del model, cks
    times: dict[str, list[float]] = {k: [] for k in (*KINDS, "read-back")}
    with vllm_engine.serving(os.path.dirname(files[0]), extension=False) as llm:
        for k in KINDS:  # once each, untimed: every path warmed up
            llm.collective_rpc(timed_reload, args=(k, files[1]))
        for r in range(rounds):
            for k in KINDS[r % len(KINDS):] + KINDS[:r % len(KINDS)]:  # each kind in each place of a round in turn
                seconds, read_back = llm.collective_rpc(timed_reload, args=(k, files[1]))[0]
                times[k].append(seconds)
                if read_back is not None:
                    times["read-back"].append(read_back)
            print(json.dumps({"model": f"{kind}:{size}", "round": r + 1, **{k: v[-1] for k, v in times.items()}}), flush=True)
    return {"model": f"{kind}:{size}", "checkpoint_bytes": os.path.getsize(files[1]), "rounds": rounds,
            "seconds": times, "median": {k: statistics.median(v) for k, v in times.items()}}


def _markdown(results: list[dict]) -> str:
    lines = ["| model | checkpoint MB | " + " | ".join(f"{k} s (median)" for k in KINDS) +
             " | mapped - vllm | fixes - mapped | fixes / vllm | every kernel read back s (median) | read-back / vllm |",
             "|---|---:|" + "---:|" * (len(KINDS) + 5)]
    for r in results:
        m = r["median"]
        lines.append(f"| {r['model']} | {r['checkpoint_bytes'] / 1e6:.1f} | " + " | ".join(f"{m[k]:.3f}" for k in KINDS) +
                     f" | {m['mapped'] - m['vllm']:+.3f} | {m['fixes'] - m['mapped']:+.3f} | {m['fixes'] / m['vllm']:.2f} | "
                     f"{m['read-back']:.3f} | {m['read-back'] / m['vllm']:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dcr_bench.vllm_pause_parts", description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="llama:medium", help="KIND:SIZE,... (default llama:medium)")
    ap.add_argument("--lr", type=float, default=3e-6, help="AdamW learning rate of the step (default 3e-6)")
    ap.add_argument("--rounds", type=int, default=8, help="rounds of the three reloads, in turn (default 8)")
    ap.add_argument("--out", default="docs/bench-vllm-pause-parts", help="where results.json and results.md go")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    results = []
    for kind, size, base in each_model(args.models, "dcr-pause-parts-"):
        print(f"dcr-bench vllm pause parts: {kind}:{size} ...", flush=True)
        results.append(run_model(kind, size, base, args.lr, args.rounds))
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({"meta": {"machine": platform.platform(), "cpus": os.cpu_count()}, "results": results}, f, indent=2)
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write(_markdown(results))
    print(_markdown(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
