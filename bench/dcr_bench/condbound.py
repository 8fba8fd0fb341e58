"""The conditional entropy bound: what an update costs given the bits the receiver already holds.

The plain bound (``bench.change_stats``) codes positions as a Bernoulli process at the observed
change rate and values as the empirical entropy of the XOR values, as if nothing else were known.
A receiver holds the old bits, and they predict both:
- **positions**: per tensor, the elements are split into classes by the old value's exponent
  field; each class's changes are a Bernoulli process at that class's own rate;
- **values**: the signed ulp step (the sign-magnitude integer difference of the bits, in value
  order), pooled over all tensors, instead of the XOR value.
A change that flips its sign, changes its exponent class or moves more than 127 ulps is an
*escape*: coded with its XOR value, its position not class-conditioned (per tensor, a Bernoulli
process at the escape rate over all elements), and left out of its class's enumeration. Tensors of
non-float dtypes have no classes: their changes are all escapes (plain positions, XOR values).
"""

from __future__ import annotations

import math
from collections import Counter

import numpy as np

# dtype name -> (exponent shift, exponent mask, sign bit) of the raw bits
FLOAT_FIELDS = {
    "BF16": (7, 0xFF, 1 << 15),
    "F16": (10, 0x1F, 1 << 15),
    "F32": (23, 0xFF, 1 << 31),
    "F64": (52, 0x7FF, 1 << 63),
}
MAX_STEP = 127


def h2(p: float) -> float:
    return 0.0 if p <= 0 or p >= 1 else -(p * math.log2(p) + (1 - p) * math.log2(1 - p))


def bernoulli_bits(n: int, k: int) -> float:
    """Bits to code which ``k`` of ``n`` elements are set, at the empirical rate."""
    return n * h2(k / n) if n else 0.0


def entropy_bits(counts) -> float:
    """Total bits to code ``sum(counts)`` symbols at their empirical entropy."""
    c = np.asarray(list(counts), dtype=np.float64)
    c = c[c > 0]
    n = c.sum()
    return float(-(c * np.log2(c / n)).sum()) if n else 0.0


def _classes(bits: np.ndarray, dtype: str) -> np.ndarray:
    shift, emask, _ = FLOAT_FIELDS[dtype]
    return ((bits >> bits.dtype.type(shift)) & bits.dtype.type(emask)).astype(np.intp)


def conditional_stats(pairs) -> dict:
    """Plain (per-tensor Bernoulli) and conditional position bits, XOR and step value bits, per change.

    ``pairs`` carry ``old``/``new`` flat raw bits and ``dtype`` (the tensor's safetensors dtype name).
    """
    total = changed = escapes = 0
    pos_plain = pos_cond = 0.0
    xor_all: dict[int, Counter] = {}  # itemsize -> XOR value counts (the plain value code)
    xor_esc: dict[int, Counter] = {}  # itemsize -> XOR value counts of the escapes
    steps = Counter()
    by_dtype: Counter = Counter()
    for p in pairs:
        old, new = p.old.reshape(-1), p.new.reshape(-1)
        n = old.size
        idx = np.flatnonzero(old != new)
        k = idx.size
        total += n
        changed += k
        pos_plain += bernoulli_bits(n, k)
        if not k:
            continue
        o, w = old[idx], new[idx]
        x = o ^ w
        _count(xor_all, x)
        fields = FLOAT_FIELDS.get(getattr(p, "dtype", ""))
        if fields is None:  # no classes: every change is an escape (plain position, XOR value)
            by_dtype["other"] += k
            escapes += k
            pos_cond += bernoulli_bits(n, k)
            _count(xor_esc, x)
            continue
        by_dtype[p.dtype] += k
        _, _, sign = fields
        t = o.dtype.type
        mag = t(sign - 1)
        so = (o & t(sign)) != 0
        oc, nc = _classes(o, p.dtype), _classes(w, p.dtype)
        mo = (o & mag).astype(np.int64)  # magnitudes fit in int64 for every float width
        mw = (w & mag).astype(np.int64)
        step = mw - mo
        np.negative(step, out=step, where=so)
        ok = (((o ^ w) & t(sign)) == 0) & (oc == nc) & (np.abs(step) <= MAX_STEP)
        esc = int(k - np.count_nonzero(ok))
        escapes += esc
        steps.update(dict(zip(*(v.tolist() for v in np.unique(step[ok], return_counts=True)))))
        if esc:
            _count(xor_esc, x[~ok])
        # positions: escapes at their own (unconditioned) rate; the rest per old exponent class,
        # over the class's elements less its escapes
        pos_cond += bernoulli_bits(n, esc)
        ncls = FLOAT_FIELDS[p.dtype][1] + 1
        n_c = np.bincount(_classes(old, p.dtype), minlength=ncls)
        n_c -= np.bincount(oc[~ok], minlength=ncls)
        k_c = np.bincount(oc[ok], minlength=ncls)
        pos_cond += sum(bernoulli_bits(int(a), int(b)) for a, b in zip(n_c, k_c) if b)
    xor_bits = sum(entropy_bits(c.values()) for c in xor_all.values())
    step_bits = entropy_bits(steps.values()) + sum(entropy_bits(c.values()) for c in xor_esc.values())
    per = (lambda b: b / changed) if changed else (lambda b: None)
    plain_bits, cond_bits = pos_plain + xor_bits, pos_cond + step_bits
    return {
        "changed": changed, "elements": total, "escapes": escapes,
        "escape_fraction": escapes / changed if changed else None,
        "changes_by_dtype": dict(by_dtype),
        "plain": {"position_bits_per_change": per(pos_plain), "value_bits_per_change": per(xor_bits),
                  "bytes_per_change": per(plain_bits / 8), "bytes": plain_bits / 8},
        "conditional": {"position_bits_per_change": per(pos_cond), "value_bits_per_change": per(step_bits),
                        "bytes_per_change": per(cond_bits / 8), "bytes": cond_bits / 8},
        "ratio": cond_bits / plain_bits if plain_bits else None,
    }


def _count(hists: dict[int, Counter], values: np.ndarray) -> None:
    if values.size:
        v, c = np.unique(values, return_counts=True)
        hists.setdefault(values.dtype.itemsize, Counter()).update(dict(zip(v.tolist(), c.tolist())))
