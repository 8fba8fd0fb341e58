"""Residual conversions: canonical values that are not a bit copy of a training value.

A conversion is elementwise (each canonical element depends only on the training element at the
same position), so it commutes with every placement: a rank converts its own shard in training
layout and projects the result. Examples: FP32 master weights cast to BF16 (round to nearest
even, exactly what ``tensor.to(torch.bfloat16)`` gives when a trainer exports a checkpoint), and a
norm weight kept as ``w - 1`` (canonical ``w = stored + 1`` in FP32, then cast).

How the change is carried: the converted shard is compared with the converted baseline (the
canonical bits of the last committed step, kept by the rank), and the XOR mask of the two goes
into the canonical chunks, like any other change. Sharded publishes never use overwrites: a part
of a chunk shared by several ranks cannot say "leave the rest alone" with new values, while XOR
masks of disjoint regions combine without coordination (see ``dcr_core.projection``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from dcr_core.errors import UsageError


@dataclass(frozen=True)
class Conversion:
    """An elementwise map from a training tensor to canonical values of dtype ``dtype``."""

    name: str
    dtype: torch.dtype
    fn: Callable[[torch.Tensor], torch.Tensor]

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        out = self.fn(t)
        if out.dtype != self.dtype or out.shape != t.shape:
            raise UsageError(
                f"conversion {self.name!r} gave {out.dtype}{list(out.shape)}, expected {self.dtype}{list(t.shape)}"
            )
        return out


def cast(dtype: torch.dtype) -> Conversion:
    """Cast (e.g. FP32 master weights -> BF16), round to nearest even."""
    return Conversion(f"cast:{dtype}", dtype, lambda t: t.to(dtype))


def offset(value: float, dtype: torch.dtype, compute: torch.dtype = torch.float32) -> Conversion:
    """``(t + value)`` computed in ``compute`` precision, then cast (norm weights kept as ``w - 1``)."""
    return Conversion(f"offset:{value}:{dtype}", dtype, lambda t: (t.to(compute) + value).to(dtype))


_REGISTRY: dict[str, Conversion] = {}


def register(name: str, conversion: Conversion) -> None:
    """Register a conversion under a name (any elementwise map a trainer needs)."""
    _REGISTRY[name] = conversion


def named(name: str) -> Conversion:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise UsageError(f"no conversion registered as {name!r}; known: {', '.join(sorted(_REGISTRY)) or 'none'}") from None


register("bf16", cast(torch.bfloat16))
register("norm_minus_one_bf16", offset(1.0, torch.bfloat16))
