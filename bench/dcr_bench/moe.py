"""MoE-shaped BF16 checkpoints: the same bytes held in few or many tensors, and a step that changes some.

``layout(total_bytes, tensors)`` names and shapes ``tensors`` tensors (exactly) holding about
``total_bytes`` of BF16: up to 16 tensors, plain matrices of equal size; more, a mixture-of-experts
model: per layer the q/k/v/o attention matrices (a fifth of the elements), two norms and a router,
and small expert matrices (gate, up, down per expert) sharing the rest. ``write_pair`` writes the
step-0 checkpoint (weights ~N(0, 0.02)) and a step-1 checkpoint with ``rate`` of the elements moved
one unit (a Bernoulli draw per element), as .safetensors files, numpy only: one buffer of all the
elements, which the tensors slice in file order, so each file is its header and that buffer.
"""

from __future__ import annotations

import json
import math
import struct

import numpy as np

PLAIN_MAX = 16  # up to this many tensors: plain matrices
LAYER_TENSORS = 400  # tensors per layer of the MoE layout (its layer count: tensors // 400)
ATTN = ("q", "k", "v", "o")
ATTN_COLS, EXPERT_COLS, HIDDEN = 256, 64, 256
EXPERT_KINDS = ("gate", "up", "down")


def layout(total_bytes: int, tensors: int) -> list[tuple[str, tuple[int, ...]]]:
    """``tensors`` (name, shape) pairs of about ``total_bytes`` of BF16 together."""
    if tensors < 1:
        raise ValueError(f"tensors must be at least 1, got {tensors}")
    elems = total_bytes // 2
    if tensors <= PLAIN_MAX:
        rows = max(1, elems // tensors // ATTN_COLS)
        return [(f"w.{i}", (rows, ATTN_COLS)) for i in range(tensors)]
    layers = max(1, tensors // LAYER_TENSORS)
    fixed = len(ATTN) + 3  # attention, two norms, the router
    if tensors < layers * (fixed + 1):
        raise ValueError(f"{tensors} tensors leave no expert matrix in {layers} layers")
    per_layer = [len(r) for r in np.array_split(np.arange(tensors - layers * fixed), layers)]
    attn_rows = max(1, elems // 5 // (layers * len(ATTN)) // ATTN_COLS)
    routers = math.ceil(max(per_layer) / len(EXPERT_KINDS))  # one router row per expert
    left = elems - layers * (len(ATTN) * attn_rows * ATTN_COLS + 2 * HIDDEN + routers * HIDDEN)
    expert_rows = max(1, left // sum(per_layer) // EXPERT_COLS)
    # what the expert rows' rounding left goes to the attention matrices: the same bytes at every count
    left = elems - layers * (2 * HIDDEN + routers * HIDDEN) - sum(per_layer) * expert_rows * EXPERT_COLS
    attn_rows = max(1, left // (layers * len(ATTN) * ATTN_COLS))
    out: list[tuple[str, tuple[int, ...]]] = []
    for layer, n in enumerate(per_layer):
        p = f"model.layers.{layer}"
        out += [(f"{p}.self_attn.{k}_proj.weight", (attn_rows, ATTN_COLS)) for k in ATTN]
        out += [(f"{p}.input_layernorm.weight", (HIDDEN,)), (f"{p}.post_attention_layernorm.weight", (HIDDEN,))]
        out.append((f"{p}.mlp.gate.weight", (routers, HIDDEN)))
        out += [(f"{p}.mlp.experts.{i // 3}.{EXPERT_KINDS[i % 3]}_proj.weight", (expert_rows, EXPERT_COLS))
                for i in range(n)]
    return out


def _header(shapes: list[tuple[str, tuple[int, ...]]]) -> bytes:
    hdr, at = {}, 0
    for name, shape in shapes:
        n = 2 * math.prod(shape)
        hdr[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [at, at + n]}
        at += n
    h = json.dumps(hdr, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    return struct.pack("<Q", len(h)) + h


def write_pair(old_path: str, new_path: str, total_bytes: int, tensors: int, rate: float = 0.03,
               seed: int = 0) -> dict:
    """Write step 0 and step 1 (``rate`` of the elements one unit away); what they hold."""
    shapes = layout(total_bytes, tensors)
    n = sum(math.prod(s) for _, s in shapes)
    rng = np.random.default_rng(seed)
    bits = ((rng.standard_normal(n, dtype=np.float32) * 0.02).view(np.uint32) >> 16).astype(np.uint16)
    header = _header(shapes)
    with open(old_path, "wb") as f:
        f.write(header)
        bits.tofile(f)
    changed = np.flatnonzero(rng.random(n, dtype=np.float32) < rate)
    bits[changed] += np.where(rng.random(changed.size) < 0.5, 1, 0xFFFF).astype(np.uint16)  # +-1, mod 2**16
    with open(new_path, "wb") as f:
        f.write(header)
        bits.tofile(f)
    return {"tensors": len(shapes), "bytes": 2 * n, "changed": int(changed.size), "elements": n}
