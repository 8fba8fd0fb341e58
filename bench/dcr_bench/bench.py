"""``dcr bench``: DCR against peer baselines and the entropy bound on the same updates, in one run."""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass

import numpy as np
import torch

from dcr_bench import commands, scaling, tensor_counts, tp_pulls
from dcr_bench import data as bench_data
from dcr_bench.condbound import conditional_stats
from dcr_bench.e2e import S3Service, e2e_local, e2e_s3, e2e_summary, startup_s
from dcr_bench.parallel import machine_reference, measure_threads
from dcr_core.bits import bits_of, dtype_of
from dcr_core.chunking import ChunkGrid, choose_chunk_shape
from dcr_core.codec import CodecSpec
from dcr_core.delta import (
    Encoding,
    apply_chunk,
    choose_encoding,
    count_changed,
    encode_chunks,
    pad,
)
from flows import PublishOptions
from flows.cli import Parser
from flows.cli.values import Number
from flows.options import COND_DELTAS
from flows.publish.pipeline import PublishSteps
from flows.receive.pipeline import StateSteps

QUICK_SIZES, DEFAULT_SIZES = "2M", "10M,100M"
QUICK_RATES, DEFAULT_RATES = "0.01,0.03,0.05", "0.005,0.01,0.03,0.05,0.10"
E2E_RATES = (0.01, 0.03, 0.05)
E2E_MAX_PARAMS = 100_000_000
DEFAULT_BANDWIDTHS = (50e6, 10e6)
PUBLISH_STEPS = tuple(s.name for s in PublishSteps.steps().values())  # the step timings, in pipeline order
RECEIVE_STEPS = tuple(s.name for s in StateSteps.steps().values())
# Peak memory per BF16 model byte: old, new, XOR temporaries, decode targets and baselines (measured:
# 7.2 for synthetic 100M, peak RSS 1.44 GB); the AdamW source also holds FP32 master weights,
# gradients, Adam moments and a saved step. A scenario runs if it needs at most MEM_BUDGET of the
# available memory.
MEM_FACTOR = {"synthetic": 7.5, "adamw": 16}
MEM_BUDGET = 0.7
SOURCES = ("synthetic", "adamw")
BACKENDS = ("local", "s3")
METHODS = {  # key -> label, in table order
    "dcr": "DCR",
    "standard": "standard blosc",
    "xor_zstd1": "XOR+zstd-1",
    "index_value_zstd1": "idx+val zstd-1",
    "patch_from_1": "patch-from -1",
    "patch_from_3": "patch-from -3",
    "full": "full checkpoint",
}


def say(msg: str) -> None:
    print(f"[bench] {msg}", flush=True)


# ---------------------------------------------------------------- arguments


def parse_size(text: str, unit: str = "parameters") -> int:
    """``2M``, ``1.5B``, ``200k`` or a plain number of parameters (or of ``unit``)."""
    t = text.strip().lower()
    scale = {"k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9}.get(t[-1:], 1)
    value = float(t[:-1] if scale != 1 else t) * scale
    if not math.isfinite(value) or value < 1024:
        raise argparse.ArgumentTypeError(f"size {text!r} is not a number of {unit} of at least 1024")
    return int(value)


def _list(text: str, conv, allowed=None) -> list:
    items = [conv(x) for x in text.split(",") if x.strip()]
    if allowed is not None:
        bad = [x for x in items if x not in allowed]
        if bad:
            raise argparse.ArgumentTypeError(f"unknown {bad}; choose from {', '.join(allowed)}")
    if not items:
        raise argparse.ArgumentTypeError("empty list")
    return items


BANDWIDTH = Number(float, 0, lo_open=True, unit="bytes/s")


def _rate(text: str) -> float:
    r = float(text)
    if not 0.0 < r <= 1.0:
        raise argparse.ArgumentTypeError(f"rate {text!r} is not within (0, 1]")
    return r


def _tensor_counts(text: str) -> list[int]:
    """Tensor counts of at least 1, or ``0`` alone (skip the section)."""
    if text.strip() == "0":
        return [0]
    return _list(text, Number(int, 1))


def build_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="dcr bench",
        description="Compare DCR's delta codec with peer baselines (dense XOR+zstd, index+value, zstd "
        "--patch-from) and the entropy bound on synthetic and AdamW updates, and time end-to-end refits "
        "against moving the full checkpoint. Writes results.json, results.md and plots.",
    )
    p.add_argument("--quick", action="store_true", help=f"small run: sizes {QUICK_SIZES}, rates {QUICK_RATES}, local only")
    p.add_argument("--out", default="bench-results", help="output directory (default bench-results/)")
    p.add_argument("--sizes", type=lambda s: _list(s, parse_size), help=f"parameters per model (default {DEFAULT_SIZES})")
    p.add_argument("--rates", type=lambda s: _list(s, _rate), help=f"change rates (default {DEFAULT_RATES})")
    p.add_argument("--sources", type=lambda s: _list(s, str.strip, SOURCES), default=list(SOURCES),
                   help="update generators (default synthetic,adamw)")
    p.add_argument("--backends", type=lambda s: _list(s, str.strip, BACKENDS),
                   help="end-to-end backends (default local,s3; --quick: local)")
    p.add_argument("--bandwidth", type=lambda s: _list(s, BANDWIDTH), default=list(DEFAULT_BANDWIDTHS),
                   help="bytes/s caps of the S3 link, each direction, one end-to-end run per cap (default 50e6,10e6)")
    p.add_argument("--e2e-size", type=parse_size, help=f"model size of the end-to-end runs (default the largest size <= {E2E_MAX_PARAMS:.0e})")
    p.add_argument("--e2e-rates", type=lambda s: _list(s, _rate), help="change rates of the end-to-end runs (default 0.01,0.03,0.05)")
    p.add_argument("--scaling-sizes", type=lambda s: _list(s, lambda x: 0 if x.strip() == "0" else parse_size(x)),
                   help="checkpoint bytes of the cost-against-size section (default 200M,700M,1.35G,2.7G; --quick "
                   "10M,40M; 0 skips it)")
    p.add_argument("--tensor-counts", type=_tensor_counts,
                   help="tensor counts of the cost-against-tensor-count section, the same bytes in each (default "
                   f"{_counts(tensor_counts.DEFAULT_COUNTS)}; --quick {_counts(tensor_counts.QUICK_COUNTS)}; 0 skips it)")
    p.add_argument("--tensor-count-bytes", type=lambda s: parse_size(s, "bytes"),
                   help=f"checkpoint bytes of that section (default {tensor_counts.DEFAULT_BYTES / 1e6:g}M; --quick "
                   f"{tensor_counts.QUICK_BYTES / 1e6:g}M)")
    p.add_argument("--tensor-count-bundle-below", type=Number(int, 0, unit="bytes"), default=None,
                   metavar="BYTES", help="--bundle-below of that section's publishes (default: dcr publish's; 0: no "
                   "bundles, every tensor stored alone: the per-tensor costs of tensors too large to bundle)")
    p.add_argument("--seed", type=Number(int, 0, 2**32 - 1), default=0, help="seed of the synthetic updates (default 0)")
    return p


def _counts(counts) -> str:
    return ",".join(str(n) for n in counts)


def resolve(a: argparse.Namespace) -> argparse.Namespace:
    """Fill the defaults that depend on --quick and on the other options."""
    a.tensor_counts = a.tensor_counts or list(tensor_counts.QUICK_COUNTS if a.quick else tensor_counts.DEFAULT_COUNTS)
    a.tensor_count_bytes = a.tensor_count_bytes or (tensor_counts.QUICK_BYTES if a.quick else tensor_counts.DEFAULT_BYTES)
    a.sizes = a.sizes or _list(QUICK_SIZES if a.quick else DEFAULT_SIZES, parse_size)
    a.rates = a.rates or _list(QUICK_RATES if a.quick else DEFAULT_RATES, _rate)
    a.backends = a.backends or (["local"] if a.quick else list(BACKENDS))
    a.patch_levels = [1] if a.quick else [1, 3]
    if a.e2e_size is None:
        fitting = [s for s in a.sizes if s <= E2E_MAX_PARAMS]
        a.e2e_size = max(fitting) if fitting else min(a.sizes)
    wanted = a.e2e_rates or [r for r in a.rates if any(math.isclose(r, e) for e in E2E_RATES)] or a.rates[:3]
    a.e2e_rates = wanted
    return a


# ---------------------------------------------------------------- machine


def machine_info() -> dict:
    cpu = "unknown"
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    info = {
        "cpu_model": cpu,
        "cores": os.cpu_count(),
        "cores_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "mem_total_bytes": _meminfo("MemTotal"),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": np.__version__,
    }
    with contextlib.suppress(Exception):
        import numcodecs

        info["numcodecs"] = numcodecs.__version__
    zstd = shutil.which("zstd")
    if zstd:
        with contextlib.suppress(Exception):
            info["zstd_cli"] = subprocess.run([zstd, "--version"], capture_output=True, text=True, check=False).stdout.strip()
    return info


def _meminfo(key: str) -> int | None:
    with contextlib.suppress(OSError), open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return None


def fits_in_memory(source: str, n_params: int) -> tuple[bool, int, int | None]:
    need = int(MEM_FACTOR[source] * 2 * n_params)
    avail = _meminfo("MemAvailable")
    return (avail is None or need <= MEM_BUDGET * avail), need, avail


# ---------------------------------------------------------------- updates


@dataclass
class Pair:
    """One tensor of an update as flat raw bits."""

    name: str
    shape: tuple[int, ...]
    old: np.ndarray
    new: np.ndarray
    dtype: str = ""  # the safetensors dtype name ("BF16", ...): the raw bits do not tell BF16 from F16


def as_pairs(old: dict[str, torch.Tensor], new: dict[str, torch.Tensor]) -> list[Pair]:
    return [Pair(n, tuple(old[n].shape), bits_of(old[n]), bits_of(new[n]), dtype_of(old[n]).name) for n in sorted(old)]


def updates(source: str, size: int, rates: list[float], seed: int):
    """Yield (target rate, old, new, extra info) for every rate of one (source, size)."""

    if source == "synthetic":
        for r in rates:
            old, new = bench_data.synthetic(size, r, seed)
            yield r, old, new, {}
        return
    log: list = []
    for r, (old, new) in zip(rates, bench_data.adamw_steps(size, len(rates), seed=seed, target_rate=rates, log=log)):
        yield r, old, new, {"lr": log[-1]["lr"], "loss": log[-1]["loss"], "model": log[-1]["config"]}


# ---------------------------------------------------------------- entropy bound


def _h2(p: float) -> float:
    return 0.0 if p <= 0 or p >= 1 else -(p * math.log2(p) + (1 - p) * math.log2(1 - p))


def change_stats(pairs: list[Pair]) -> dict:
    """Changed elements and the entropy bound: Bernoulli(p) positions plus the empirical entropy of XOR values."""
    total = changed = 0
    hist16 = np.zeros(1 << 16, dtype=np.int64)
    other: dict[int, Counter] = {}
    for p in pairs:
        x = np.bitwise_xor(p.old, p.new)
        nz = x[x != 0]
        total += x.size
        changed += nz.size
        if x.dtype.itemsize == 2:
            hist16 += np.bincount(nz.view(np.uint16), minlength=1 << 16)
        elif nz.size:
            vals, counts = np.unique(nz, return_counts=True)
            other.setdefault(x.dtype.itemsize, Counter()).update(dict(zip(vals.tolist(), counts.tolist())))
    value_bits = _entropy_bits(hist16[hist16 > 0])
    for c in other.values():
        value_bits += _entropy_bits(np.array(list(c.values())))
    rate = changed / total if total else 0.0
    pos = _h2(rate) / rate if changed else 0.0
    vals = value_bits / changed if changed else 0.0
    return {
        "elements": total, "changed": changed, "change_rate": rate,
        "bound": {
            "position_bits_per_change": pos, "value_bits_per_change": vals,
            "bytes_per_change": (pos + vals) / 8 if changed else None,
            "bytes": (pos + vals) / 8 * changed,
        },
    }


def _entropy_bits(counts: np.ndarray) -> float:
    """Total bits to code ``counts.sum()`` symbols at their empirical entropy."""
    n = counts.sum()
    if not n:
        return 0.0
    q = counts / n
    return float(-(counts * np.log2(q)).sum())


# ---------------------------------------------------------------- DCR codec


def standard_codec() -> CodecSpec:
    """The standard Zarr Blosc chain DCR used before its own sparse codec."""
    try:
        return CodecSpec(name="blosc", clevel=1, shuffle="shuffle", blocksize=1 << 20)
    except TypeError:  # a CodecSpec without codec names is always Blosc
        return CodecSpec(clevel=1, shuffle="shuffle", blocksize=1 << 20)


def _encode(pairs: list[Pair], codec: CodecSpec, chunk_bytes: int, overwrite_above: float) -> list:
    """What the publisher stores for an update: per tensor, XOR per chunk, compress (and, as the
    publisher does, count a tensor's changes first only when overwrites are enabled)."""
    out = []
    for p in pairs:
        grid = ChunkGrid(p.shape, choose_chunk_shape(p.shape, p.new.dtype.itemsize, chunk_bytes))
        if overwrite_above >= 1.0:
            enc = Encoding.XOR
        else:
            enc = choose_encoding(count_changed(p.new, p.old), p.new.size, overwrite_above)
        for c in encode_chunks(p.new, p.old, grid, enc):
            out.append((p, grid, c.index, enc, codec.encode(pad(c.payload, grid.chunk_numel))))
    return out


def _decode_apply(payloads: list, codec: CodecSpec, targets: dict[str, np.ndarray]) -> None:
    for p, grid, index, enc, data in payloads:
        start, stop = grid.chunk_range(index)
        bits = codec.decode(data, p.new.dtype, grid.chunk_numel)[: stop - start]
        apply_chunk(targets[p.name], grid, index, bits, enc)


def _repeats(nbytes: int) -> int:
    # Best of at least 3 (the machine may be shared); small models run in milliseconds, so they get
    # up to 5 so that timer noise does not dominate.
    return max(3, min(5, (64 << 20) // max(1, nbytes)))


def measure_codec(pairs: list[Pair], codec: CodecSpec, opts: PublishOptions) -> dict:
    """Stored bytes, single-thread encode and decode+apply throughput, and a bit-exact check."""
    nbytes = sum(p.new.nbytes for p in pairs)
    enc_s = dec_s = math.inf
    payloads: list = []
    exact = True
    for _ in range(_repeats(nbytes)):
        t0 = time.perf_counter()
        payloads = _encode(pairs, codec, opts.chunk_bytes, opts.overwrite_above)
        enc_s = min(enc_s, time.perf_counter() - t0)
        targets = {p.name: p.old.copy() for p in pairs}
        t0 = time.perf_counter()
        _decode_apply(payloads, codec, targets)
        dec_s = min(dec_s, time.perf_counter() - t0)
        exact = exact and all(np.array_equal(targets[p.name], p.new) for p in pairs)
        del targets
    stored = sum(len(x[-1]) for x in payloads)
    return {
        "codec": codec.to_dict(), "bytes": stored, "chunks": len(payloads), "exact": exact,
        "encode_s": enc_s, "decode_apply_s": dec_s,
        "encode_gbps": nbytes / enc_s / 1e9, "decode_apply_gbps": nbytes / dec_s / 1e9,
    }


# ---------------------------------------------------------------- baselines


def _zstd1():
    from numcodecs import Zstd

    return Zstd(level=1)


def baseline_xor_zstd(pairs: list[Pair]) -> dict:
    """Dense XOR of every tensor, zstd level 1 per tensor (the ModelExpress / Fireworks style)."""
    z = _zstd1()
    t0 = time.perf_counter()
    stored = sum(len(z.encode(np.bitwise_xor(p.old, p.new))) for p in pairs)
    return {"bytes": stored, "encode_s": time.perf_counter() - t0}


def baseline_index_value(pairs: list[Pair]) -> dict:
    """int32 flat index + new value of each changed element, zstd level 1 per tensor (PULSE / SparseRL style)."""
    z = _zstd1()
    t0 = time.perf_counter()
    stored = 0
    for p in pairs:
        idx = np.flatnonzero(p.old != p.new)
        if idx.size:
            blob = idx.astype(np.int32).tobytes() + p.new[idx].tobytes()
            stored += len(z.encode(np.frombuffer(blob, dtype=np.uint8)))
    return {"bytes": stored, "encode_s": time.perf_counter() - t0}


def baseline_patch_from(old_file: str, new_file: str, level: int, tmp: str) -> dict:
    """``zstd --patch-from=old new -LEVEL``: a generic binary delta of the checkpoint files."""
    zstd = shutil.which("zstd")
    if not zstd:
        return {"bytes": None, "unavailable": "zstd CLI not found"}
    out = os.path.join(tmp, f"patch-{level}.zst")
    t0 = time.perf_counter()
    r = subprocess.run(
        [zstd, "-q", "-f", f"-{level}", f"--patch-from={old_file}", new_file, "-o", out],
        capture_output=True, text=True, check=False,
    )
    elapsed = time.perf_counter() - t0
    if r.returncode != 0:
        return {"bytes": None, "unavailable": f"zstd failed: {r.stderr.strip()[:200]}"}
    size = os.path.getsize(out)
    os.remove(out)
    return {"bytes": size, "encode_s": elapsed}


def _save(tensors: dict[str, torch.Tensor], path: str) -> str:
    from safetensors.torch import save_file

    save_file(tensors, path)
    return path


# ---------------------------------------------------------------- one scenario


def measure_scenario(old, new, a: argparse.Namespace, tmp: str, opts: PublishOptions) -> dict:
    pairs = as_pairs(old, new)
    stats = change_stats(pairs)
    changed = stats["changed"]
    new_file = _save(new, os.path.join(tmp, "new.safetensors"))
    full = os.path.getsize(new_file)
    methods: dict[str, dict] = {"full": {"bytes": full}}
    methods["dcr"] = measure_codec(pairs, opts.delta_codec, opts)
    threads = measure_threads(pairs, opts.delta_codec, opts.chunk_bytes)
    threads["machine_reference"] = machine_reference()
    if threads["bytes"] != methods["dcr"]["bytes"]:
        threads["same_bytes"] = False
    methods["dcr_cond"] = measure_threads(pairs, COND_DELTAS, opts.chunk_bytes, conditional=True)
    std = standard_codec()
    if std == opts.delta_codec:
        methods["standard"] = {**methods["dcr"], "same_as_dcr": True}
    else:
        methods["standard"] = measure_codec(pairs, std, opts)
    methods["xor_zstd1"] = baseline_xor_zstd(pairs)
    methods["index_value_zstd1"] = baseline_index_value(pairs)
    old_file = _save(old, os.path.join(tmp, "old.safetensors")) if shutil.which("zstd") else None
    for level in (1, 3):
        key = f"patch_from_{level}"
        if level not in a.patch_levels:
            methods[key] = {"bytes": None, "unavailable": "skipped (--quick)"}
        elif old_file is None:
            methods[key] = {"bytes": None, "unavailable": "zstd CLI not found"}
        else:
            methods[key] = baseline_patch_from(old_file, new_file, level, tmp)
    if old_file:
        os.remove(old_file)
    dcr_bytes = methods["dcr"]["bytes"]
    for m in methods.values():
        b = m.get("bytes")
        m["bytes_per_change"] = b / changed if b is not None and changed else None
        m["ratio_to_dcr"] = b / dcr_bytes if b is not None and dcr_bytes else None
    bound = stats["bound"]["bytes_per_change"]
    cbound = conditional_stats(pairs)
    cb = cbound["conditional"]["bytes_per_change"]
    for key in ("dcr", "standard", "dcr_cond"):
        b = methods[key]["bytes_per_change"]
        methods[key]["ratio_to_bound"] = b / bound if b is not None and bound else None
        methods[key]["ratio_to_conditional_bound"] = b / cb if b is not None and cb else None
    return {**stats, "conditional_bound": cbound, "full_bytes": full, "model_bytes": sum(p.new.nbytes for p in pairs),
            "tensors": len(pairs), "methods": methods, "threads": threads, "new_file": new_file}


# ---------------------------------------------------------------- output


def _f(x, fmt: str = ".2f", none: str = "n/a") -> str:
    return none if x is None else format(x, fmt)


def _params(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n / 1e3:.0f}k"


def markdown(results: dict) -> str:
    sc = results["scenarios"]
    lines = [f"# dcr bench\n\n`{' '.join(results['command'])}`\n",
             (f"Machine: {results['machine']['cpu_model']}, {results['machine']['cores_usable']} cores; "
             f"python {results['machine']['python']}, torch {results['machine']['torch']}.\n")]
    if sc:
        keys = [k for k in METHODS if k != "full"]
        lines += [
            "## Bytes per changed element (lower is better)\n",
            "Bound: Bernoulli(p) positions at the observed change rate plus the empirical entropy of the XOR values.\n",
            "| source | params | change % | bound | " + " | ".join(METHODS[k] for k in keys) + " | full | DCR / bound |",
            "|---|---:|---:|---:|" + "---:|" * len(keys) + "---:|---:|",
        ]
        for s in sc:
            m = s["methods"]
            lines.append(
                f"| {s['source']} | {_params(s['parameters'])} | {100 * s['change_rate']:.2f} | "
                f"{_f(s['bound']['bytes_per_change'], '.3f')} | "
                + " | ".join(_f(m[k]["bytes_per_change"], ".3f") for k in keys)
                + f" | {_f(m['full']['bytes_per_change'], '.1f')} | {_f(m['dcr']['ratio_to_bound'], '.3f')} |"
            )
        ratio_keys = [k for k in METHODS if k != "dcr"]
        lines += [
            "\n## Bytes relative to DCR (method / DCR; above 1 means DCR stores less)\n",
            "| source | params | change % | DCR bytes | " + " | ".join(METHODS[k] for k in ratio_keys) + " |",
            "|---|---:|---:|---:|" + "---:|" * len(ratio_keys),
        ]
        for s in sc:
            m = s["methods"]
            lines.append(
                f"| {s['source']} | {_params(s['parameters'])} | {100 * s['change_rate']:.2f} | {m['dcr']['bytes']:,} | "
                + " | ".join(_f(m[k]["ratio_to_dcr"]) for k in ratio_keys) + " |"
            )
        lines += [
            "\n## Speed (one thread; GB/s of canonical checkpoint bytes)\n",
            ("| source | params | change % | DCR encode | DCR decode+apply | standard encode | standard decode+apply "
            "| XOR+zstd-1 encode | patch-from -1 s | exact |"),
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|:--:|",
        ]
        for s in sc:
            m, gb = s["methods"], s["model_bytes"] / 1e9
            xz = m["xor_zstd1"]
            lines.append(
                f"| {s['source']} | {_params(s['parameters'])} | {100 * s['change_rate']:.2f} | "
                f"{_f(m['dcr']['encode_gbps'])} | {_f(m['dcr']['decode_apply_gbps'])} | "
                f"{_f(m['standard']['encode_gbps'])} | {_f(m['standard']['decode_apply_gbps'])} | "
                f"{_f(gb / xz['encode_s'] if xz.get('encode_s') else None)} | {_f(m['patch_from_1'].get('encode_s'))} | "
                f"{'yes' if m['dcr']['exact'] and m['standard']['exact'] else 'NO'} |"
            )
    if sc:
        lines += _conditional_markdown(sc) + _threads_markdown(sc)
    if results["end_to_end"]:
        lines += _e2e_markdown(results)
    if results.get("tp_pulls"):
        lines += tp_pulls.markdown(results["tp_pulls"])
    if results.get("commands"):
        lines += commands.markdown(results["commands"])
    if results.get("scaling"):
        lines += scaling.markdown(results["scaling"])
    if results.get("tensor_counts"):
        lines += tensor_counts.markdown(results["tensor_counts"])
    for s in results["skipped"]:
        lines.append(f"\nSkipped: {s}")
    if results.get("plots_skipped"):
        lines.append(f"\nPlots skipped: {results['plots_skipped']}")
    return "\n".join(lines) + "\n"


def _conditional_markdown(sc: list[dict]) -> list[str]:
    lines = [
        "\n## The conditional bound: what the receiver's old bits are worth\n",
        ("Plain: per tensor, Bernoulli positions at the tensor's change rate, plus the empirical entropy of the "
         "XOR values. Conditional: per tensor and old exponent class, Bernoulli positions at the class's rate, plus "
         "the empirical entropy of the signed ulp step; escapes (sign or exponent class changes, steps beyond "
         "+-127 ulps, non-float dtypes) are coded with their XOR value, their positions at their own rate "
         "over the whole tensor. Bits per changed element; bytes per changed element for the bounds and codecs. "
         "DCR-cond: the conditional codec (`dcr.cond`, coded against the old bits).\n"),
        ("| source | params | change % | positions plain | positions cond | values XOR | values step | escapes % | "
         "plain bound | cond bound | cond / plain | DCR | DCR / cond bound | DCR-cond | DCR-cond / bound | "
         "DCR-cond / cond bound | DCR-cond exact |"),
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|:--:|",
    ]
    for s in sc:
        c, m = s.get("conditional_bound"), s["methods"]
        if not c:
            continue
        pl, co, dc = c["plain"], c["conditional"], m.get("dcr_cond", {})
        esc = c["escape_fraction"]
        lines.append(
            f"| {s['source']} | {_params(s['parameters'])} | {100 * s['change_rate']:.2f} | "
            f"{_f(pl['position_bits_per_change'])} | {_f(co['position_bits_per_change'])} | "
            f"{_f(pl['value_bits_per_change'])} | {_f(co['value_bits_per_change'])} | "
            f"{_f(100 * esc if esc is not None else None)} | {_f(pl['bytes_per_change'], '.3f')} | "
            f"{_f(co['bytes_per_change'], '.3f')} | {_f(c['ratio'], '.3f')} | {_f(m['dcr']['bytes_per_change'], '.3f')} | "
            f"{_f(m['dcr'].get('ratio_to_conditional_bound'), '.3f')} | {_f(dc.get('bytes_per_change'), '.3f')} | "
            f"{_f(dc.get('ratio_to_bound'), '.3f')} | {_f(dc.get('ratio_to_conditional_bound'), '.3f')} | "
            f"{'n/a' if 'exact' not in dc else 'yes' if dc['exact'] and dc['same_bytes'] else 'NO'} |"
        )
    return lines


def _threads_markdown(sc: list[dict]) -> list[str]:
    lines = [
        "\n## Speed on 1 and 2 threads (GB/s of canonical checkpoint bytes)\n",
        ("A thread pool over the chunks, each thread encoding or decoding whole chunks (the same stored bytes "
         "whatever the thread count: `same bytes`); best of at least 3, the thread counts taking turns. "
         "`machine 2/1`: the same pool running zstd-1 of fixed buffers (no GIL held, nothing allocated per task), "
         "measured right after: what a second thread can gain on this machine at that moment. DCR-cond: the "
         "conditional codec (`dcr.cond`).\n"),
        ("| source | params | change % | DCR encode 1t | 2t | 2t/1t | DCR decode+apply 1t | 2t | 2t/1t | "
         "machine 2/1 | same bytes | DCR-cond encode 1t | 2t | DCR-cond decode+apply 1t | 2t |"),
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|:--:|---:|---:|---:|---:|",
    ]
    for s in sc:
        th = s.get("threads")
        if not th:
            continue
        t, dc = th["threads"], s["methods"].get("dcr_cond", {}).get("threads", {})

        def g(d, w, k):
            return _f(d.get(w, {}).get(k))

        lines.append(
            f"| {s['source']} | {_params(s['parameters'])} | {100 * s['change_rate']:.2f} | "
            f"{g(t, '1', 'encode_gbps')} | {g(t, '2', 'encode_gbps')} | {_f(th['encode_ratio'])} | "
            f"{g(t, '1', 'decode_apply_gbps')} | {g(t, '2', 'decode_apply_gbps')} | {_f(th['decode_apply_ratio'])} | "
            f"{_f(th.get('machine_reference', {}).get('ratio'))} | {'yes' if th['same_bytes'] and th['exact'] else 'NO'} | "
            f"{g(dc, '1', 'encode_gbps')} | {g(dc, '2', 'encode_gbps')} | "
            f"{g(dc, '1', 'decode_apply_gbps')} | {g(dc, '2', 'decode_apply_gbps')} |"
        )
    return lines


def _e2e_markdown(results: dict) -> list[str]:
    startup = results.get("startup_s", {})
    lines = [
        "\n## End to end: delta publish + receive vs moving the full checkpoint (up + down)\n",
        ("`in-process`: a long-running `Publisher` publishing the in-memory tensors (it keeps the committed "
         "policy in memory as its next baseline: no baseline file is read or written), then `run_receive` "
         "patching the receiver's state file in place (what a trainer and a receiver calling the library pay); "
         "`rewrite receive s`: the same receive with the default rewrite of the state file instead (not in the "
         "total); `on link`: its bytes on the wire over the link rate; `local`: the "
         "rest. `commands`: the same refit as a `dcr publish` (of the checkpoint file) and a `dcr receive --in-place` process; "
         f"one process start-up (interpreter and imports) alone takes {', '.join(f'{v:.2f} s ({k})' for k, v in startup.items())}. "
         "`target s`: the DCR time that would give time/byte = 0.8. `full`: the full checkpoint up + down through "
         "the same link (`full direct`: the same uncapped, the test server's own cost, included in `full`). "
         "`requests`: HTTP requests of the in-process refit through the proxy (publish and receive). "
         "`server CPU s`: CPU time the S3 test server and the proxy used during the in-process refit, on the same "
         "cores as DCR (a remote store would not take it).\n"),
        ("| backend | link MB/s | source | params | change % | byte ratio | full s | full direct s | target s | "
         "in-process s | on link s | local s | requests | server CPU s | time/byte | rewrite receive s | commands s | "
         "commands time/byte | exact |"),
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|:--:|",
    ]
    for e in results["end_to_end"]:
        d, c, f = e["dcr"], e["cli"], e["full"]
        bw = e.get("bandwidth")
        lines.append(
            f"| {e['backend']} | {_f(bw / 1e6 if bw else None, 'g', 'none')} | {e['source']} | {_params(e['parameters'])} | "
            f"{100 * e['change_rate']:.2f} | {_f(e['byte_ratio'], '.1f')} | {f['total_s']:.2f} | "
            f"{_f(f.get('unthrottled_direct_s'))} | {_f(e['target_dcr_s'], '.3f')} | {d['total_s']:.2f} | "
            f"{_f(d['link_s'])} | {d['local_s']:.2f} | {_f(d.get('requests'), 'd')} | {_f(d.get('server_cpu_s'))} | "
            f"{_f(e['quotient'])} | "
            f"{_f(d.get('receive_rewrite_s'))} | {c['total_s']:.2f} | "
            f"{_f(e['cli_quotient'])} | {'yes' if d['exact'] and c['exact'] else 'NO'} |"
        )
    kinds = sorted({k for e in results["end_to_end"] for k in e["dcr"].get("request_kinds", {})})
    if kinds:
        lines += [
            "\n### Requests of the in-process refit, by what they touch (publish and receive)\n",
            "| link MB/s | source | tensors | change % | " + " | ".join(kinds) + " | total |",
            "|---:|---|---:|---:|" + "---:|" * (len(kinds) + 1),
        ]
        for e in results["end_to_end"]:
            rk, bw = e["dcr"].get("request_kinds"), e.get("bandwidth")
            if rk:
                lines.append(f"| {_f(bw / 1e6 if bw else None, 'g', 'none')} | {e['source']} | {_f(e.get('tensors'), 'd')} | "
                             f"{100 * e['change_rate']:.2f} | " + " | ".join(str(rk.get(k, 0)) for k in kinds)
                             + f" | {e['dcr']['requests']} |")
    pub_keys = [k for k in PUBLISH_STEPS if any(k in e["dcr"]["publish_timings"] for e in results["end_to_end"])]
    rec_keys = [k for k in RECEIVE_STEPS if any(k in e["dcr"]["receive_timings"] for e in results["end_to_end"])]
    lines += [
        "\n### Where the in-process time goes (s per pipeline step)\n",
        "| backend | link MB/s | source | change % | " + " | ".join(f"publish: {k}" for k in pub_keys) + " | "
        + " | ".join(f"receive: {k}" for k in rec_keys) + " |",
        "|---|---:|---|---:|" + "---:|" * (len(pub_keys) + len(rec_keys)),
    ]
    for e in results["end_to_end"]:
        pt, rt, bw = e["dcr"]["publish_timings"], e["dcr"]["receive_timings"], e.get("bandwidth")
        lines.append(
            f"| {e['backend']} | {_f(bw / 1e6 if bw else None, 'g', 'none')} | {e['source']} | {100 * e['change_rate']:.2f} | "
            + " | ".join(_f(pt.get(k)) for k in pub_keys) + " | " + " | ".join(_f(rt.get(k)) for k in rec_keys) + " |"
        )
    return lines


def plot(results: dict, out: str) -> list[str]:
    """The PNG plots; raises ImportError without matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    groups: dict[tuple, list] = {}
    for s in results["scenarios"]:
        groups.setdefault((s["source"], s["parameters"]), []).append(s)
    if groups:
        fig, axes = plt.subplots(1, len(groups), figsize=(5.5 * len(groups), 4.5), squeeze=False)
        for ax, ((source, n), ss) in zip(axes[0], sorted(groups.items())):
            ss = sorted(ss, key=lambda s: s["change_rate"])
            x = [100 * s["change_rate"] for s in ss]
            for k, label in METHODS.items():
                y = [s["methods"][k]["bytes_per_change"] for s in ss]
                if any(v is not None for v in y):
                    style = "o-" if k == "dcr" else ":" if k == "full" else ".-"
                    ax.plot(x, [math.nan if v is None else v for v in y], style, label=label,
                            linewidth=2.5 if k == "dcr" else 1.2)
            ax.plot(x, [s["bound"]["bytes_per_change"] or math.nan for s in ss], "k--", label="entropy bound")
            ax.set_yscale("log")
            ax.set_xlabel("change rate (%)")
            ax.set_ylabel("bytes per changed element")
            ax.set_title(f"{source}, {_params(n)} params")
            ax.grid(True, which="both", alpha=0.3)
        axes[0][0].legend(fontsize=8)
        fig.tight_layout()
        path = os.path.join(out, "bytes_per_change.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    e2e: dict[tuple, list] = {}
    for e in results["end_to_end"]:
        e2e.setdefault((e["source"], e["parameters"], e["backend"], -(e.get("bandwidth") or 0)), []).append(e)
    if e2e:
        rows = sorted({k[:2] for k in e2e})
        cols = sorted({k[2:] for k in e2e})
        fig, axes = plt.subplots(len(rows), len(cols), figsize=(5 * len(cols), 4.2 * len(rows)), squeeze=False)
        for ax in axes.flat:
            ax.set_visible(False)
        for (source, n, backend, neg_bw), es in sorted(e2e.items()):
            ax = axes[rows.index((source, n))][cols.index((backend, neg_bw))]
            ax.set_visible(True)
            es = sorted(es, key=lambda e: e["change_rate"])
            pos = np.arange(len(es))
            link = [e["dcr"]["link_s"] or 0.0 for e in es]
            ax.bar(pos - 0.27, link, 0.27, label="DCR in-process: on link")
            ax.bar(pos - 0.27, [e["dcr"]["local_s"] for e in es], 0.27, bottom=link, label="DCR in-process: local")
            ax.bar(pos, [e["cli"]["total_s"] for e in es], 0.27, label="DCR as dcr commands")
            up = [e["full"]["upload_s"] for e in es]
            ax.bar(pos + 0.27, up, 0.27, label="full upload")
            ax.bar(pos + 0.27, [e["full"]["download_s"] for e in es], 0.27, bottom=up, label="full download")
            ax.set_xticks(pos, [f"{100 * e['change_rate']:.1f}%" for e in es])
            ax.set_xlabel("change rate")
            ax.set_ylabel("refit time (s)")
            ax.set_title(f"{backend}{f' @ {-neg_bw / 1e6:g} MB/s' if neg_bw else ''}: {source}, {_params(n)}")
            ax.grid(True, axis="y", alpha=0.3)
        handles, labels = next(ax for ax in axes.flat if ax.get_visible()).get_legend_handles_labels()
        fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=9)
        fig.tight_layout(rect=(0, 0.05, 1, 1))
        path = os.path.join(out, "refit_time.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    if results.get("scaling"):
        written.append(scaling.plot(results["scaling"], out, plt))
    if results.get("tensor_counts"):
        written.append(tensor_counts.plot(results["tensor_counts"], out, plt))
    return written


def write_outputs(results: dict, out: str) -> str:
    os.makedirs(out, exist_ok=True)
    try:
        results["plots"] = [os.path.basename(p) for p in plot(results, out)]
    except ImportError as e:
        results["plots"], results["plots_skipped"] = [], f"matplotlib is not importable ({e})"
        say(f"plots skipped: {results['plots_skipped']}")
    md = markdown(results)
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write(md)
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(results, f, indent=2, default=str)
    return md


# ---------------------------------------------------------------- main


def run(a: argparse.Namespace, command: list[str]) -> dict:
    opts = PublishOptions()
    results = {"command": command, "machine": machine_info(), "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
               "config": {"sizes": a.sizes, "rates": a.rates, "sources": a.sources, "backends": a.backends,
                          "bandwidth": a.bandwidth, "e2e_size": a.e2e_size, "e2e_rates": a.e2e_rates,
                          "seed": a.seed, "quick": a.quick, "tensor_counts": a.tensor_counts,
                          "tensor_count_bytes": a.tensor_count_bytes, "chunk_bytes": opts.chunk_bytes,
                          "delta_codec": opts.delta_codec.to_dict(), "standard_codec": standard_codec().to_dict()},
               "scenarios": [], "end_to_end": [], "skipped": []}
    t_start = time.perf_counter()
    with contextlib.ExitStack() as stack:
        s3 = _start_s3(a, stack, results) if "s3" in a.backends else None
        tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="dcr-bench-"))
        for source in a.sources:
            for size in a.sizes:
                ok, need, avail = fits_in_memory(source, size)
                if not ok:
                    msg = (f"{source} {_params(size)}: needs about {need / 2**30:.1f} GiB, more than {MEM_BUDGET:.0%} of "
                           f"{avail / 2**30:.1f} GiB available")
                    say(f"skipped {msg}")
                    results["skipped"].append(msg)
                    continue
                say(f"{source} {_params(size)}: generating updates for rates {', '.join(f'{r:g}' for r in a.rates)}")
                for rate, old, new, extra in updates(source, size, a.rates, a.seed):
                    _scenario(a, source, size, rate, old, new, extra, tmp, opts, s3, results)
                    del old, new
                    gc.collect()
        t0 = time.perf_counter()
        results["tp_pulls"] = tp_pulls.measure(tmp, a.quick, seed=a.seed)
        say("per-rank pulls (share of the step per rank): " + "; ".join(
            f"blocks {r['column_blocks']} TP{r['tp']} {max(r['share_ratio']):.2f}x" for r in results["tp_pulls"]["rows"])
            + f" ({time.perf_counter() - t0:.1f}s)")
        t0 = time.perf_counter()
        results["commands"] = commands.measure(tmp, a.quick, seed=a.seed)
        c = results["commands"]
        say(f"commands: publish {c['publish_best_s']:.2f}s vs zstd -1 -T1 {_f(c['zstd_1_T1_s'])}s; start-up "
            + ", ".join(f"{k} {v:.2f}s" for k, v in c["startup_s"].items()) + f" ({time.perf_counter() - t0:.1f}s)")
        if a.scaling_sizes != [0]:
            t0 = time.perf_counter()
            results["scaling"] = scaling.measure(tmp, a.quick, seed=a.seed, sizes=a.scaling_sizes)
            say("cost against size: " + "; ".join(
                f"{r['pattern']} {r['bytes'] / 1e9:.2f} GB publish {r['publish_delta_s']:.2f}s in-place "
                f"{r['receive_in_place_s']:.2f}s" for r in results["scaling"]["rows"]) + f" ({time.perf_counter() - t0:.1f}s)")
        if a.tensor_counts != [0]:
            t0 = time.perf_counter()
            say(f"cost against tensor count: {_counts(a.tensor_counts)} tensors of {a.tensor_count_bytes / 1e6:g} MB")
            results["tensor_counts"] = tensor_counts.measure(tmp, a.tensor_counts, a.backends, s3, a.tensor_count_bytes,
                                                             seed=a.seed, log=say,
                                                             bundle_below=a.tensor_count_bundle_below)
            say(f"cost against tensor count done ({time.perf_counter() - t0:.1f}s)")
    results["wall_s"] = time.perf_counter() - t_start
    return results


def _start_s3(a: argparse.Namespace, stack: contextlib.ExitStack, results: dict) -> S3Service | None:
    try:
        svc = stack.enter_context(S3Service(a.bandwidth[0]))
    except (ImportError, RuntimeError) as e:
        msg = f"s3 backend unavailable: {e} (needs moto[server], boto3, s3fs)"
        say(f"skipped {msg}")
        results["skipped"].append(msg)
        return None
    caps = ", ".join(f"{b / 1e6:g}" for b in a.bandwidth)
    say(f"s3: moto at {svc.direct}, capped proxy at {svc.proxy.url} ({caps} MB/s each way)")
    return svc


def _scenario(a, source, size, rate, old, new, extra, tmp, opts, s3, results) -> None:
    t0 = time.perf_counter()
    n = sum(t.numel() for t in old.values())
    s = measure_scenario(old, new, a, tmp, opts)
    new_file = s.pop("new_file")
    s = {"source": source, "size_target": size, "rate_target": rate, "parameters": n, **extra, **s}
    results["scenarios"].append(s)
    m = s["methods"]
    say(
        f"{source} {_params(n)} rate {100 * s['change_rate']:.2f}%: bound {_f(s['bound']['bytes_per_change'], '.3f')} "
        f"DCR {_f(m['dcr']['bytes_per_change'], '.3f')} B/chg (x{_f(m['dcr']['ratio_to_bound'], '.2f')} bound), "
        f"xor+zstd x{_f(m['xor_zstd1']['ratio_to_dcr'])}, idx+val x{_f(m['index_value_zstd1']['ratio_to_dcr'])}, "
        f"patch-1 x{_f(m['patch_from_1']['ratio_to_dcr'])}; enc {m['dcr']['encode_gbps']:.2f} GB/s, "
        f"dec {m['dcr']['decode_apply_gbps']:.2f} GB/s ({time.perf_counter() - t0:.1f}s)"
    )
    th, cb, dc = s["threads"], s["conditional_bound"], m["dcr_cond"]
    say(
        f"  2 threads: enc x{_f(th['encode_ratio'])}, dec x{_f(th['decode_apply_ratio'])} (machine "
        f"x{_f(th['machine_reference']['ratio'])}); cond bound {_f(cb['conditional']['bytes_per_change'], '.3f')} "
        f"B/chg (x{_f(cb['ratio'], '.3f')} plain); DCR-cond {_f(dc['bytes_per_change'], '.3f')} B/chg"
        + (f" (x{_f(dc['ratio_to_conditional_bound'], '.2f')} cond bound, exact {'yes' if dc['exact'] else 'NO'})"
           if "exact" in dc else "")
    )
    if size == a.e2e_size and any(math.isclose(rate, r) for r in a.e2e_rates):
        for backend in a.backends:
            if backend == "s3" and s3 is None:
                continue
            for bw in a.bandwidth if backend == "s3" else [None]:
                _e2e(a, backend, bw, source, n, rate, s, old, new, new_file, tmp, s3, results)
    os.remove(new_file)


def _startup(backend: str, results: dict) -> float:
    """Process start-up of one ``dcr`` command (interpreter and imports), measured once per backend."""
    cache = results.setdefault("startup_s", {})
    if backend not in cache:
        cache[backend] = startup_s(", s3fs" if backend == "s3" else "")
    return cache[backend]


def _e2e(a, backend, bw, source, n, rate, s, old, new, new_file, tmp, s3, results) -> None:
    t1 = time.perf_counter()
    startup = _startup(backend, results)
    if backend == "local":
        r = e2e_local(old, new, new_file, tmp, startup)
    else:
        r = e2e_s3(s3, bw, old, new, new_file, tmp, startup)
    e = e2e_summary({"backend": backend, "source": source, "parameters": n, "rate_target": rate,
                     "change_rate": s["change_rate"], "tensors": len(new), **r})
    results["end_to_end"].append(e)
    say(e2e_line(e) + f" ({time.perf_counter() - t1:.1f}s)")


def ratio(x: float | None) -> str:
    """A ratio as ``x``-times, with the digits it needs: ``x33``, ``x4.2``, ``x0.43``, ``x0.043``
    (a DCR refit slower than the full copy reads as a fraction, never as ``x0.0``)."""
    if x is None:
        return "n/a"
    return f"x{x:.0f}" if x >= 100 else f"x{x:.1f}" if x >= 1 else f"x{x:.2g}"


def e2e_line(e: dict) -> str:
    """One end-to-end refit (an ``e2e_summary``) as the progress line ``dcr bench`` prints: the
    in-process split into publish and receive (and the time its bytes alone take on the link,
    where there is a capped link), the same as commands, the full checkpoint, and the ratios."""
    d, c, bw = e["dcr"], e["cli"], e.get("bandwidth")
    link = "" if bw is None else f" @ {bw / 1e6:g} MB/s"
    on_link = "" if d.get("link_s") is None else f"; on link {d['link_s']:.2f}s"
    return (f"  e2e {e['backend']}{link}: DCR in-process {d['total_s']:.2f}s (publish {d['publish_s']:.2f} + receive "
            f"{d['receive_s']:.2f}{on_link}), as commands {c['total_s']:.2f}s; full {e['full']['total_s']:.2f}s; "
            f"bytes {ratio(e['byte_ratio'])}, time {ratio(e['time_ratio'])} (commands {ratio(e['cli_time_ratio'])}), "
            f"exact {'yes' if d['exact'] and c['exact'] else 'NO'}")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    a = resolve(build_parser().parse_args(argv))
    say(f"sizes {', '.join(_params(s) for s in a.sizes)}; rates {', '.join(f'{r:g}' for r in a.rates)}; "
        f"sources {', '.join(a.sources)}; backends {', '.join(a.backends)}; out {a.out}")
    results = run(a, ["dcr", "bench", *argv])
    md = write_outputs(results, a.out)
    say(f"done in {results['wall_s']:.1f}s; wrote {os.path.join(a.out, 'results.json')}, results.md"
        + "".join(f", {p}" for p in results["plots"]))
    print(md)
    inexact = [s for s in results["scenarios"] if not s["methods"]["dcr"]["exact"]]
    inexact += [s for s in results["scenarios"] if not (s["threads"]["exact"] and s["threads"]["same_bytes"])]
    inexact += [s for s in results["scenarios"]
                if "exact" in s["methods"]["dcr_cond"] and not (s["methods"]["dcr_cond"]["exact"]
                                                                and s["methods"]["dcr_cond"]["same_bytes"])]
    inexact += [e for e in results["end_to_end"] if not (e["dcr"]["exact"] and e["cli"]["exact"])]
    inexact += [r for r in results.get("tp_pulls", {}).get("rows", []) if not r["exact"]]
    inexact += [r for r in results.get("scaling", {}).get("rows", []) if not r["exact"]]
    inexact += [r for r in results.get("tensor_counts", {}).get("rows", []) if not r["exact"]]
    if inexact:
        print("dcr bench: some refits were not bit-exact (see results.json)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
