"""``dcr simulate --calibrate``: this machine's per-byte CPU costs, measured with DCR's own code.

For each dtype (BF16, FP32) and codec (the publisher's default ``dcr.sparse`` and the standard Blosc
chain), a realistic update (Gaussian weights, ``rate`` of them moved by a small step) is encoded the
way the publisher does it (XOR per chunk, compress) and decoded and applied the way a receiver does
(``dcr_bench.bench.measure_codec``: one thread, best of 3-5), and BLAKE3 digests one pass over the
raw bits (``dcr_core.digest.tensor_digest``), and one copy of the tensors into fresh memory
(``torch.Tensor.clone``: the publisher's snapshot, the receiver's install). Every cost is a throughput in GB/s of raw model bytes
per thread: a per-byte cost of 1 / (rate * 1e9) seconds.
"""

from __future__ import annotations

import json
import os
import platform
import time

import numpy as np
import torch

from dcr_bench import data as bench_data
from dcr_bench.bench import as_pairs, measure_codec, standard_codec
from dcr_bench.sim.scenario import PER_TENSOR_SECTION
from dcr_core.digest import tensor_digest
from flows import PublishOptions

DEFAULT_ELEMENTS = 16_000_000
FP32_STEP = 1e-5  # absolute step of a changed FP32 weight (an Adam update at lr ~1e-5 on weights ~N(0, 0.02))


def fp32_pair(n_params: int, rate: float, seed: int = 0) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """FP32 weights ~N(0, 0.02) in Llama-like tensors and a copy with ``rate`` of them moved by ~1e-5."""
    rng = np.random.default_rng(seed)
    old, new = {}, {}
    for name, shape in bench_data.synthetic_shapes(n_params):
        size = int(np.prod(shape))
        w = (rng.standard_normal(size, dtype=np.float32) * np.float32(0.02)).astype(np.float32)
        moved = w.copy()
        idx = np.flatnonzero(rng.random(size, dtype=np.float32) < rate)
        step = rng.standard_normal(idx.size, dtype=np.float32) * np.float32(FP32_STEP)
        moved[idx] = w[idx] + step
        old[name], new[name] = torch.from_numpy(w).reshape(shape), torch.from_numpy(moved).reshape(shape)
    return old, new


def pair(dtype: str, n_params: int, rate: float, seed: int = 0):
    if dtype == "float32":
        return fp32_pair(n_params, rate, seed)
    if dtype == "bfloat16":
        return bench_data.synthetic(n_params, rate, seed)
    raise ValueError(f"no generator for {dtype}")


def changed_elements(old: dict, new: dict) -> int:
    return sum(int((a.view(torch.uint8) != b.view(torch.uint8)).reshape(a.numel(), -1).any(1).sum())
               for a, b in ((old[k], new[k]) for k in old))


def digest_rate(pairs, repeats: int = 5) -> float:
    nbytes = sum(p.new.nbytes for p in pairs)
    best = float("inf")
    tensor_digest(pairs[0].new)  # warm up: the first pass pays for page faults and the library's set-up
    for _ in range(repeats):
        t0 = time.perf_counter()
        for p in pairs:
            tensor_digest(p.new)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


def copy_rate(new: dict, repeats: int = 3) -> float:
    """One copy of every tensor into fresh memory (what a snapshot or installing a result costs)."""
    nbytes = sum(t.numel() * t.element_size() for t in new.values())
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        copies = [t.clone() for t in new.values()]
        best = min(best, time.perf_counter() - t0)
        del copies
    return nbytes / best / 1e9


def codecs() -> dict:
    default = PublishOptions().delta_codec
    out = {default.name: default}
    std = standard_codec()
    out.setdefault(std.name, std)
    return out


def calibrate(elements: int = DEFAULT_ELEMENTS, rate: float = 0.03, dtypes=("bfloat16", "float32"),
              seed: int = 0, say=print) -> dict:
    """Measure the costs; returns the calibration document."""
    t_start = time.perf_counter()
    opts = PublishOptions()
    costs: dict[str, dict] = {}
    for dtype in dtypes:
        old, new = pair(dtype, elements, rate, seed)
        pairs = as_pairs(old, new)
        changed = changed_elements(old, new)
        dig = digest_rate(pairs)
        copy = copy_rate(new)
        for name, codec in codecs().items():
            m = measure_codec(pairs, codec, opts)
            if not m["exact"]:
                raise RuntimeError(f"calibration: {name} {dtype} did not round-trip bit-exactly")
            costs.setdefault(name, {})[dtype] = {
                "encode_gb_per_s": m["encode_gbps"], "decode_apply_gb_per_s": m["decode_apply_gbps"],
                "digest_gb_per_s": dig, "copy_gb_per_s": copy, "bytes_per_change": m["bytes"] / changed if changed else None,
                "change_rate": changed / sum(p.new.size for p in pairs), "elements": sum(p.new.size for p in pairs),
            }
            c = costs[name][dtype]
            say(f"{name} {dtype}: encode {c['encode_gb_per_s']:.3f} GB/s, decode+apply {c['decode_apply_gb_per_s']:.3f} "
                f"GB/s, digest {dig:.3f} GB/s, copy {copy:.3f} GB/s, {c['bytes_per_change']:.3f} B per changed element")
        del old, new, pairs
    return {
        "what": "per-byte CPU costs of DCR on this machine (GB/s of raw model bytes, one thread)",
        "machine": {"cpu": _cpu_model(), "cores": os.cpu_count(), "python": platform.python_version(),
                    "torch": torch.__version__},
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "seconds": time.perf_counter() - t_start,
        "chunk_bytes": opts.chunk_bytes, "costs": costs,
    }


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "unknown")
    except OSError:
        return platform.processor() or "unknown"


def write(doc: dict, path: str) -> None:
    """Write ``doc`` to ``path``, keeping the file's per-tensor costs of each layout (``per_tensor``,
    ``per_tensor_per_object``): they are measured apart (publishes and receives of one checkpoint in few
    and in many tensors, see docs/simulate.md), not here."""
    try:
        with open(path) as f:
            old = json.load(f)
        kept = {k: old[k] for k in PER_TENSOR_SECTION.values() if k in old}
    except (OSError, ValueError, TypeError):
        kept = {}
    doc = {**doc, **{k: v for k, v in kept.items() if k not in doc}}
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(doc, f, indent=2)
        f.write("\n")
