"""How the commands' cost grows with the model: publish and receive time against checkpoint size.

For each size (a BF16 checkpoint of 4096-wide tensors, 4096 to 11008 rows as in a Llama layer,
weights ~N(0, 0.02)) and each of two change patterns, every command runs as a user runs it (its own
process, ``--orchestrator none``, a local ROOT), timed wall clock with its peak resident memory:

- *fixed rate*: ``rate`` of the elements move by one unit at every size;
- *fixed change*: the same number of elements changes at every size (``rate`` of the smallest);
- *frozen 3/4*: ``rate`` of the elements of every fourth tensor change, the others keep every bit
  (frozen layers): what block digests kept beside an in-place receiver's state save;
- *fixed change, clustered*: the changes of *fixed change*, all in the leading tensors that make up
  the smallest size (the rest of a larger model frozen): the cost that follows the change alone,
  where *fixed change* scatters the same changes over every block of the model.

Commands: ``dcr publish`` of the keyframe, ``dcr publish`` of the delta (warm baseline cache),
``dcr receive`` of the delta by rewrite and ``--in-place`` (each receiver at the keyframe first; the
in-place one in its steady state: a receive with nothing to apply ran once, which keeps its block
digests, and a second one is timed as *idle*: what a receiver polling an idle ROOT pays), and
``zstd -q -1 -T1`` of the new file for scale. The machine's memory-read and disk-write speeds are
measured beside them: one read of the checkpoint at memory speed is the floor of a publisher that
compares every element, one write of the changed bytes the floor of a receiver.

Every command starts with nothing dirty in the page cache (``sync`` first), so none pays for the
writeback of the one before. What a command leaves the disk to write after it returns (the
publisher's baseline cache, the in-place receiver's patched pages: neither is fsynced on the
command's path) is timed apart, as the ``sync`` that follows it (``*_writeback_s``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time

import numpy as np

from dcr_bench.commands import _dcr_argv
from dcr_core.dtypes import TensorInfo
from storage.local.safetensors import SafetensorsCheckpoint, StreamingSafetensorsWriter

WIDTH = 4096
ROWS = (4096, 11008, 4096, 4096, 11008, 11008)  # a layer's q, gate, k, o, up, down (transposed): cycled
PATTERNS = ("fixed rate", "fixed change", "frozen 3/4", "fixed change, clustered")
FULL_SIZES = (200e6, 700e6, 1.35e9, 2.7e9)
QUICK_SIZES = (10e6, 40e6)


def _shapes(size: float) -> list[tuple[int, int]]:
    """Tensors of the row counts above (the last one cut to fit) adding up to about ``size`` bytes."""
    left, out, i = int(size) // (2 * WIDTH), [], 0
    while left > 0:
        rows = min(ROWS[i % len(ROWS)], left)
        out.append((rows, WIDTH))
        left -= rows
        i += 1
    return out


def _write(path: str, shapes: list[tuple[int, int]], seed: int, changes: int | None, every: int = 1,
           first: int | None = None) -> None:
    """The checkpoint of ``shapes``; with ``changes``, that many elements (spread evenly over every
    ``every``-th tensor of the ``first`` ones, at random places) one unit away from the
    ``changes=None`` file of the same seed."""
    first = len(shapes) if first is None else first

    def changing(i: int) -> bool:
        return i % every == 0 and i < first

    n_total = sum(r * c for i, (r, c) in enumerate(shapes) if changing(i))
    infos = [TensorInfo(f"layers.{i:03d}.weight", "BF16", s) for i, s in enumerate(shapes)]
    w = StreamingSafetensorsWriter(path, infos, durable=False)
    for i, (info, (r, c)) in enumerate(zip(infos, shapes)):
        rng = np.random.default_rng((seed, i))
        bits = ((rng.standard_normal(r * c, dtype=np.float32) * 0.02).view(np.uint32) >> 16).astype(np.uint16)
        if changes and changing(i):
            k = round(changes * r * c / n_total)
            pos = np.random.default_rng((seed, i, 1)).choice(r * c, size=k, replace=False)
            bits[pos] += np.where(pos % 2 == 0, 1, -1).astype(np.uint16)
        w.write(info.name, bits)
    w.commit()


def _writeback() -> float:
    """Seconds until everything dirty in the page cache is on disk."""
    t0 = time.perf_counter()
    os.sync()
    return time.perf_counter() - t0


def _run(argv: list[str], env: dict) -> tuple[float, int]:
    """Wall seconds and peak resident bytes of one command (GNU time's %M), started with nothing
    dirty in the page cache."""
    os.sync()
    t0 = time.perf_counter()
    out = subprocess.run(["/usr/bin/time", "-f", "%M", *argv], env=env, capture_output=True, text=True)
    elapsed = time.perf_counter() - t0
    if out.returncode:
        raise RuntimeError(f"{' '.join(os.path.basename(a) for a in argv[:3])} failed: {out.stderr.strip()[-600:]}")
    return elapsed, int(out.stderr.strip().splitlines()[-1]) * 1024


def machine_speeds(work: str, nbytes: int = 1 << 30) -> dict:
    """Memory read (a sum over a buffer in cache-sized pieces) and disk write (written and fsynced) in GB/s."""
    a = np.ones(nbytes // 8, dtype=np.float64)
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        a.sum()
        best = min(best, time.perf_counter() - t0)
    path = os.path.join(work, "disk-probe")
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        a.tofile(f)
        f.flush()
        os.fsync(f.fileno())
    write_s = time.perf_counter() - t0
    os.remove(path)
    return {"memory_read_gbps": nbytes / best / 1e9, "disk_write_gbps": nbytes / write_s / 1e9}


def _one(work: str, size: float, changes: int, seed: int, env: dict, dcr: list[str], every: int = 1,
         first: int | None = None) -> dict:
    d = os.path.join(work, f"scale-{int(size)}")
    os.makedirs(d, exist_ok=True)
    shapes = _shapes(size)
    old, new = os.path.join(d, "old.safetensors"), os.path.join(d, "new.safetensors")
    _write(old, shapes, seed, None)
    _write(new, shapes, seed, changes, every, first)
    root = os.path.join(d, "root")
    common = ["--orchestrator", "none", "-q"]
    e = {**env, "DCR_CACHE_DIR": os.path.join(d, "cache")}
    row: dict = {"bytes": os.path.getsize(new), "tensors": len(shapes), "changed": changes}
    row["publish_keyframe_s"], row["publish_keyframe_rss"] = _run([*dcr, "publish", root, old, "--step", "0", *common], e)
    states = {m: os.path.join(d, f"state-{m}.safetensors") for m in ("rewrite", "in_place")}
    for m, s in states.items():
        _run([*dcr, "receive", root, "--receiver", m.replace("_", "-"), "--state", s, *common], e)
    in_place = [*dcr, "receive", root, "--receiver", "in-place", "--state", states["in_place"], "--in-place", *common]
    _run(in_place, e)  # nothing to apply: the state hashed once, its block digests kept (steady state)
    row["receive_idle_s"], _ = _run(in_place, e)
    row["publish_delta_s"], row["publish_delta_rss"] = _run([*dcr, "publish", root, new, "--step", "1", *common], e)
    row["publish_delta_writeback_s"] = _writeback()
    row["receive_rewrite_s"], row["receive_rewrite_rss"] = _run(
        [*dcr, "receive", root, "--receiver", "rewrite", "--state", states["rewrite"], *common], e)
    row["receive_in_place_s"], row["receive_in_place_rss"] = _run(in_place, e)
    row["receive_in_place_writeback_s"] = _writeback()
    zstd = shutil.which("zstd")
    if zstd:
        out = os.path.join(d, "new.zst")
        row["zstd_1_T1_s"], _ = _run([zstd, "-q", "-1", "-T1", "-f", new, "-o", out], e)
    row["exact"] = all(same_tensors(s, new) for s in states.values())  # both receivers hold the new bits
    shutil.rmtree(d, ignore_errors=True)
    return row


def same_tensors(a: str, b: str) -> bool:
    """Both files hold the same tensors (names, dtypes, shapes, bits), whatever their metadata."""
    with SafetensorsCheckpoint(a) as x, SafetensorsCheckpoint(b) as y:
        return x.infos == y.infos and all(np.array_equal(x.bits(n), y.bits(n)) for n in x.infos)


def measure(work: str, quick: bool = False, rate: float = 0.03, seed: int = 0, sizes=None) -> dict:
    sizes = tuple(sizes or (QUICK_SIZES if quick else FULL_SIZES))
    work = os.path.join(work, "scaling")
    os.makedirs(work, exist_ok=True)
    dcr, env = _dcr_argv(), dict(os.environ)
    fixed_changes = round(rate * min(sizes) / 2)
    rows = []
    for pattern in PATTERNS:
        every = 4 if pattern == "frozen 3/4" else 1
        first = len(_shapes(min(sizes))) if pattern == "fixed change, clustered" else None
        for size in sizes:
            changes = fixed_changes if pattern.startswith("fixed change") else round(rate * size / 2 / every)
            rows.append({"pattern": pattern, "size_target": size,
                         **_one(work, size, changes, seed, env, dcr, every, first)})
    speeds = machine_speeds(work, 256 << 20 if quick else 1 << 30)
    shutil.rmtree(work, ignore_errors=True)
    return {"rate": rate, "rows": rows, **speeds}


def markdown(res: dict) -> list[str]:
    lines = [
        "\n## Cost against model size (commands, local ROOT)\n",
        (f"BF16 checkpoints of 4096-wide tensors; *fixed rate*: {100 * res['rate']:g}% of elements one unit away; "
         f"*fixed change*: as many changes as {100 * res['rate']:g}% of the smallest; *frozen 3/4*: "
         f"{100 * res['rate']:g}% of every fourth tensor; *fixed change, clustered*: the changes of *fixed change* "
         "in the leading tensors that make up the smallest size. Each command its own process; "
         f"peak RSS in MB. This machine: memory read {res['memory_read_gbps']:.1f} GB/s, disk write "
         f"{res['disk_write_gbps']:.2f} GB/s (one read of the checkpoint at memory speed: `read s`). Every command "
         "starts with nothing dirty; `(+N)`: the writeback it left, timed as the `sync` after it. The in-place "
         "receiver is in its steady state (block digests kept); `idle s`: its receive with nothing to apply.\n"),
        ("| pattern | GB | changed | publish keyframe s | publish delta s (+writeback) | zstd -1 -T1 s | receive rewrite s | "
         "receive --in-place s (+writeback) | idle s | read s | peak RSS MB (pub delta / in-place) | exact |"),
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|:--:|",
    ]
    for r in res["rows"]:
        z = r.get("zstd_1_T1_s")
        lines.append(
            f"| {r['pattern']} | {r['bytes'] / 1e9:.2f} | {r['changed']:,} | {r['publish_keyframe_s']:.2f} | "
            f"{r['publish_delta_s']:.2f}{_left(r, 'publish_delta')} | {'n/a' if z is None else f'{z:.2f}'} | "
            f"{r['receive_rewrite_s']:.2f} | {r['receive_in_place_s']:.2f}{_left(r, 'receive_in_place')} | "
            f"{r['receive_idle_s']:.2f} | "
            f"{r['bytes'] / 1e9 / res['memory_read_gbps']:.3f} | "
            f"{r['publish_delta_rss'] / 1e6:.0f} / {r['receive_in_place_rss'] / 1e6:.0f} | {'yes' if r['exact'] else 'NO'} |")
    return lines


def _left(row: dict, what: str) -> str:
    s = row.get(f"{what}_writeback_s")
    return "" if s is None else f" (+{s:.2f})"


def plot(res: dict, out: str, plt) -> str:
    """Time against size, one panel per pattern, with one memory-speed read and one disk-speed write
    of the checkpoint for scale; returns the PNG's path."""
    fig, axes = plt.subplots(1, len(PATTERNS), figsize=(5.3 * len(PATTERNS), 4.5), squeeze=False)
    for ax, pattern in zip(axes[0], PATTERNS):
        rows = sorted((r for r in res["rows"] if r["pattern"] == pattern), key=lambda r: r["bytes"])
        gb = [r["bytes"] / 1e9 for r in rows]
        for key, label in (("publish_delta_s", "dcr publish (delta)"), ("zstd_1_T1_s", "zstd -1 -T1"),
                           ("receive_rewrite_s", "dcr receive (rewrite)"), ("receive_in_place_s", "dcr receive --in-place")):
            if all(key in r for r in rows):
                ax.plot(gb, [r[key] for r in rows], marker="o", label=label)
        ax.plot(gb, [g / res["memory_read_gbps"] for g in gb], linestyle="--", color="gray", label="one read at memory speed")
        ax.plot(gb, [g / res["disk_write_gbps"] for g in gb], linestyle=":", color="gray", label="one write at disk speed")
        ax.set_xlabel("checkpoint GB")
        ax.set_ylabel("seconds")
        ax.set_title(f"{pattern} ({100 * res['rate']:g}%{' of the smallest' if pattern.startswith('fixed change') else ''})")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    path = os.path.join(out, "scaling.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
