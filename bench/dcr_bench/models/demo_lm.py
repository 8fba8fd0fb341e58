"""The demo's model: a small Llama-style LM (GQA attention, gated MLP, RMSNorm, a persistent rotary
buffer) trained with AdamW, and its canonical BF16 checkpoint (from FP32 master weights)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

# At this rate AdamW's first steps move ~1-3% of the BF16 weights (init std 0.02) per step,
# the order of magnitude seen when refitting RL policies.
DEFAULT_LR = 1e-6


@dataclass(frozen=True)
class ModelConfig:
    vocab: int = 8192
    hidden: int = 512
    layers: int = 4
    heads: int = 8
    kv_heads: int = 2  # grouped-query attention: k/v projections are narrower than q
    intermediate: int = 1376
    seq_len: int = 64
    batch: int = 8


class RMSNorm(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class Rotary(nn.Module):
    def __init__(self, head_dim: int):
        super().__init__()
        # A persistent buffer: it is part of the checkpoint but never trained.
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ang = torch.outer(torch.arange(x.shape[-2], dtype=torch.float32), self.inv_freq)
        cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
        x1, x2 = x.chunk(2, -1)
        return x * cos + torch.cat([-x2, x1], -1) * sin


class Attention(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.c, hd = c, c.hidden // c.heads
        self.q_proj = nn.Linear(c.hidden, c.heads * hd, bias=False)
        self.k_proj = nn.Linear(c.hidden, c.kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(c.hidden, c.kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(c.heads * hd, c.hidden, bias=False)

    def forward(self, x: torch.Tensor, rope: Rotary) -> torch.Tensor:
        b, t, _ = x.shape
        c, rep = self.c, self.c.heads // self.c.kv_heads
        q = rope(self.q_proj(x).view(b, t, c.heads, -1).transpose(1, 2))
        k = rope(self.k_proj(x).view(b, t, c.kv_heads, -1).transpose(1, 2)).repeat_interleave(rep, 1)
        v = self.v_proj(x).view(b, t, c.kv_heads, -1).transpose(1, 2).repeat_interleave(rep, 1)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(o.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden, c.intermediate, bias=False)
        self.up_proj = nn.Linear(c.hidden, c.intermediate, bias=False)
        self.down_proj = nn.Linear(c.intermediate, c.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.input_layernorm, self.post_attention_layernorm = RMSNorm(c.hidden), RMSNorm(c.hidden)
        self.self_attn, self.mlp = Attention(c), MLP(c)

    def forward(self, x: torch.Tensor, rope: Rotary) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope)
        return x + self.mlp(self.post_attention_layernorm(x))


class Body(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab, c.hidden)
        self.layers = nn.ModuleList(Layer(c) for _ in range(c.layers))
        self.norm = RMSNorm(c.hidden)
        self.rotary_emb = Rotary(c.hidden // c.heads)


class DemoLM(nn.Module):
    """Module names follow Hugging Face Llama-style checkpoints (model.layers.N.self_attn.q_proj...)."""

    def __init__(self, c: ModelConfig):
        super().__init__()
        self.model = Body(c)
        self.lm_head = nn.Linear(c.hidden, c.vocab, bias=False)
        for p in self.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.model.embed_tokens(ids)
        for layer in self.model.layers:
            h = layer(h, self.model.rotary_emb)
        return self.lm_head(self.model.norm(h))


def canonical(model: nn.Module) -> dict[str, torch.Tensor]:
    """The published checkpoint: BF16 casts of the FP32 master weights, buffers as they are."""
    params = {n for n, _ in model.named_parameters()}
    return {
        n: (t.detach().to(torch.bfloat16) if n in params else t.detach()).contiguous()
        for n, t in model.state_dict().items()
    }


def train_step(model: nn.Module, opt: torch.optim.Optimizer, c: ModelConfig, gen: torch.Generator) -> float:
    ids = torch.randint(0, c.vocab, (c.batch, c.seq_len + 1), generator=gen)
    loss = F.cross_entropy(model(ids[:, :-1]).reshape(-1, c.vocab), ids[:, 1:].reshape(-1))
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return loss.item()
