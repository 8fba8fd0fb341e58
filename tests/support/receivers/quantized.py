"""Receivers whose loaders transform bits: FP8 block quantization, offset norms, and a re-chunked expert stack."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import torch
from torch import nn

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
BLOCK = 32

# A spec is (name, shape) or (name, shape, dtype); the dtype defaults to the receiver's.
Spec = tuple[str, Sequence[int]] | tuple[str, Sequence[int], torch.dtype]


def specs_of(checkpoint: Mapping[str, torch.Tensor]) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """The (name, shape, dtype) of every tensor in a canonical checkpoint."""
    return [(k, tuple(v.shape), v.dtype) for k, v in checkpoint.items()]


def _owner(root: nn.Module, name: str) -> tuple[nn.Module, str]:
    """The submodule that holds ``name``'s leaf, created on demand, so named_parameters keeps the canonical path."""
    *path, leaf = name.split(".")
    mod = root
    for part in path:
        if part not in mod._modules:
            mod.add_module(part, nn.Module())
        mod = mod._modules[part]
    return mod, leaf


def _zeros(shape: Sequence[int], dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.zeros(*shape, dtype=dtype), requires_grad=False)


def _normalize(spec: Spec, dtype: torch.dtype) -> tuple[str, tuple[int, ...], torch.dtype]:
    name, shape, *rest = spec
    return name, tuple(shape), rest[0] if rest else dtype


class _SpecReceiver(nn.Module):
    """Base: one param per canonical name (leaf registered under its own dotted path), strict on unknown names."""

    def __init__(self, specs: Iterable[Spec], dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        self.names: dict[str, None] = {}  # ordered set of canonical names
        for spec in specs:
            name, shape, dt = _normalize(spec, dtype)
            self.names[name] = None
            self._register(name, shape, dt)

    @classmethod
    def from_checkpoint(cls, checkpoint: Mapping[str, torch.Tensor]):
        return cls(specs_of(checkpoint))

    def _register(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        mod, leaf = _owner(self, name)
        mod.register_parameter(leaf, _zeros(shape, dtype))

    def _param(self, name: str) -> nn.Parameter:
        if name not in self.names:
            raise KeyError(f"no param for checkpoint name {name!r}")
        mod, leaf = _owner(self, name)
        return getattr(mod, leaf)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loaded = set()
        for name, tensor in weights:
            self._load_one(name, tensor)
            loaded.add(name)
        return loaded

    def _load_one(self, name: str, tensor: torch.Tensor) -> None:
        param = self._param(name)
        if param.shape != tensor.shape:
            raise ValueError(f"{name}: shape {tuple(tensor.shape)} does not fit {tuple(param.shape)}")
        param.data.copy_(tensor)


def _blocks(n: int) -> int:
    return -(-n // BLOCK)


def quantize_fp8_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per 32x32 block: scale = amax / 448 (F32, 1 where the block is all zero), q = fp8(w / scale)."""
    rows, cols = w.shape
    w32 = w.float()
    pr, pc = _blocks(rows) * BLOCK, _blocks(cols) * BLOCK
    padded = torch.zeros(pr, pc, dtype=torch.float32)
    padded[:rows, :cols] = w32
    tiles = padded.view(pr // BLOCK, BLOCK, pc // BLOCK, BLOCK)
    amax = tiles.abs().amax(dim=(1, 3))
    # Guard zero (and subnormal-tiny) blocks: a zero scale would turn 0/0 into NaN.
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    full = scale.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[:rows, :cols]
    q = (w32 / full).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


def dequantize_fp8_blocks(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """F32 approximation of the original weight."""
    rows, cols = q.shape
    full = scale.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[:rows, :cols]
    return q.float() * full


class Fp8BlockQuantized(_SpecReceiver):
    """NOT bit-preserving: 2-D weights become FP8 (e4m3fn) with an F32 ``weight_scale`` per 32x32 block."""

    def _register(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        mod, leaf = _owner(self, name)
        if len(shape) != 2:
            mod.register_parameter(leaf, _zeros(shape, dtype))
            return
        mod.register_parameter(leaf, _zeros(shape, FP8))
        # vLLM names the scale after the weight: "weight" -> "weight_scale".
        mod.register_parameter(f"{leaf}_scale", _zeros((_blocks(shape[0]), _blocks(shape[1])), torch.float32))

    def _load_one(self, name: str, tensor: torch.Tensor) -> None:
        param = self._param(name)
        if param.shape != tensor.shape:
            raise ValueError(f"{name}: shape {tuple(tensor.shape)} does not fit {tuple(param.shape)}")
        if tensor.dim() != 2:
            param.data.copy_(tensor)
            return
        q, scale = quantize_fp8_blocks(tensor)
        mod, leaf = _owner(self, name)
        param.data.copy_(q)
        getattr(mod, f"{leaf}_scale").data.copy_(scale)

    def dequantized(self, name: str) -> torch.Tensor:
        """The F32 value a kernel would see for ``name``."""
        param = self._param(name)
        if param.dtype != FP8:
            return param.data.float()
        mod, leaf = _owner(self, name)
        return dequantize_fp8_blocks(param.data, getattr(mod, f"{leaf}_scale").data)


def is_norm(name: str) -> bool:
    return "norm" in name and name.endswith(".weight")


class OffsetNorm(_SpecReceiver):
    """Arithmetic, not placement: norm weights are stored as ``w - 1`` (F32 math, cast back); the rest is copied."""

    def _load_one(self, name: str, tensor: torch.Tensor) -> None:
        if not is_norm(name):
            super()._load_one(name, tensor)
            return
        param = self._param(name)
        if param.shape != tensor.shape:
            raise ValueError(f"{name}: shape {tuple(tensor.shape)} does not fit {tuple(param.shape)}")
        param.data.copy_((tensor.float() - 1.0).to(param.dtype))


class RechunkedExperts(nn.Module):
    """Pure placement, but not a copy: ``experts.{e}.w1.weight`` [I, H] go into one [E*I/2, 2*H] stack.

    Experts are stored in reverse order; each expert's top and bottom row halves sit side by side.
    """

    def __init__(self, num_experts: int = 4, intermediate: int = 16, hidden: int = 8, dtype=torch.bfloat16):
        super().__init__()
        if intermediate % 2:
            raise ValueError("intermediate must be even")
        self.num_experts, self.intermediate, self.hidden = num_experts, intermediate, hidden
        half = intermediate // 2
        self.w1 = nn.Parameter(torch.zeros(num_experts * half, 2 * hidden, dtype=dtype), requires_grad=False)
        self.w1.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, expert_id: int) -> None:
        i, h = self.intermediate, self.hidden
        if tuple(loaded.shape) != (i, h):
            raise ValueError(f"expert {expert_id}: shape {tuple(loaded.shape)} != {(i, h)}")
        half, slot = i // 2, self.num_experts - 1 - expert_id
        block = param.data.narrow(0, slot * half, half)
        block[:, :h].copy_(loaded[:half])
        block[:, h:].copy_(loaded[half:])

    def _expert_id(self, name: str) -> int:
        parts = name.split(".")
        if len(parts) != 4 or parts[0] != "experts" or parts[2:] != ["w1", "weight"] or not parts[1].isdigit():
            raise KeyError(f"no param for checkpoint name {name!r}")
        e = int(parts[1])
        if e >= self.num_experts:
            raise KeyError(f"no expert {e} for checkpoint name {name!r}")
        return e

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        for name, tensor in weights:
            self.w1.weight_loader(self.w1, tensor, self._expert_id(name))
        return {"w1"}

    @staticmethod
    def checkpoint(seed: int, num_experts: int = 4, intermediate: int = 16, hidden: int = 8,
                   dtype=torch.bfloat16) -> dict[str, torch.Tensor]:
        """The canonical per-expert checkpoint this receiver expects."""
        g = torch.Generator().manual_seed(seed)
        return {
            f"experts.{e}.w1.weight": torch.randn(intermediate, hidden, generator=g).to(dtype)
            for e in range(num_experts)
        }
