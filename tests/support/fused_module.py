"""A tiny receiver module in vLLM's style: fused qkv / gate_up with per-shard weight loaders."""

from __future__ import annotations

import torch
from torch import nn


class TinyFused(nn.Module):
    """Holds q/k/v fused as ``qkv`` and gate/up fused as ``gate_up``; ``load_weights`` places them."""

    def __init__(self, hidden: int = 8, kv: int = 4, inter: int = 12, dtype=torch.bfloat16):
        super().__init__()
        self.hidden, self.kv, self.inter = hidden, kv, inter
        self.qkv = nn.Parameter(torch.zeros(hidden + 2 * kv, hidden, dtype=dtype), requires_grad=False)
        self.gate_up = nn.Parameter(torch.zeros(2 * inter, hidden, dtype=dtype), requires_grad=False)
        self.norm = nn.Parameter(torch.zeros(hidden, dtype=dtype), requires_grad=False)
        self.register_buffer("inv_freq", torch.zeros(hidden // 2, dtype=torch.float32))

    def _slot(self, name: str):
        h, kv, i = self.hidden, self.kv, self.inter
        table = {
            "layer.q_proj.weight": (self.qkv, 0, h),
            "layer.k_proj.weight": (self.qkv, h, kv),
            "layer.v_proj.weight": (self.qkv, h + kv, kv),
            "layer.gate_proj.weight": (self.gate_up, 0, i),
            "layer.up_proj.weight": (self.gate_up, i, i),
        }
        return table.get(name)

    def load_weights(self, weights):
        for name, w in weights:
            slot = self._slot(name)
            if slot is not None:
                param, start, size = slot
                param.data.narrow(0, start, size).copy_(w)
            elif name == "layer.norm.weight":
                self.norm.data.copy_(w)
            elif name == "rotary.inv_freq":
                self.inv_freq.copy_(w)
            else:
                raise KeyError(name)

    @staticmethod
    def checkpoint(seed: int, hidden: int = 8, kv: int = 4, inter: int = 12) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        r = lambda *s: torch.randn(*s, generator=g).bfloat16()
        return {
            "layer.q_proj.weight": r(hidden, hidden),
            "layer.k_proj.weight": r(kv, hidden),
            "layer.v_proj.weight": r(kv, hidden),
            "layer.gate_proj.weight": r(inter, hidden),
            "layer.up_proj.weight": r(inter, hidden),
            "layer.norm.weight": r(hidden),
            "rotary.inv_freq": torch.arange(hidden // 2, dtype=torch.float32),
        }
