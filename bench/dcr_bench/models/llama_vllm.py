"""A tensor-parallel Llama receiver in vLLM's layout: fused qkv / gate_up, vocab padding, per-param weight loaders."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn

# (fused param name, canonical shard name, shard id), exactly as vLLM's LlamaForCausalLM spells it.
STACKED_PARAMS_MAPPING = [
    (".qkv_proj", ".q_proj", "q"),
    (".qkv_proj", ".k_proj", "k"),
    (".qkv_proj", ".v_proj", "v"),
    (".gate_up_proj", ".gate_proj", 0),
    (".gate_up_proj", ".up_proj", 1),
]
VOCAB_PAD = 64


@dataclass
class LlamaConfig:
    vocab_size: int = 250
    hidden_size: int = 64
    intermediate_size: int = 96
    num_layers: int = 2
    num_heads: int = 8
    num_kv_heads: int = 2
    tie_word_embeddings: bool = False
    dtype: torch.dtype = torch.bfloat16

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor) -> None:
    """Replicated params (norms): a whole-tensor copy; shapes must agree so a wrong name cannot broadcast."""
    if param.shape != loaded.shape:
        raise ValueError(f"shape {tuple(loaded.shape)} does not fit param {tuple(param.shape)}")
    param.data.copy_(loaded)


def _param(*shape: int, dtype: torch.dtype, loader: Callable | None = None) -> nn.Parameter:
    # Zeros, not empty: padding rows must be deterministic so two receivers can be compared bit for bit.
    p = nn.Parameter(torch.zeros(*shape, dtype=dtype), requires_grad=False)
    if loader is not None:
        p.weight_loader = loader
    return p


def padded_vocab(vocab_size: int, tp_size: int) -> int:
    """Vocab rounded up to a multiple of 64 * tp_size, so every rank holds the same number of rows."""
    unit = VOCAB_PAD * tp_size
    return math.ceil(vocab_size / unit) * unit


class VocabParallelEmbedding(nn.Module):
    """Rank r holds rows [r * per_rank, (r + 1) * per_rank) of the padded vocab; rows past the real vocab stay zero."""

    def __init__(self, vocab_size: int, hidden: int, tp_rank: int, tp_size: int, dtype: torch.dtype):
        super().__init__()
        self.vocab_size, self.tp_rank = vocab_size, tp_rank
        self.per_rank = padded_vocab(vocab_size, tp_size) // tp_size
        self.weight = _param(self.per_rank, hidden, dtype=dtype, loader=self.weight_loader)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        if loaded.shape[0] != self.vocab_size:
            raise ValueError(f"vocab {loaded.shape[0]} != {self.vocab_size}")
        start = self.tp_rank * self.per_rank
        n = max(0, min(self.vocab_size - start, self.per_rank))
        param.data[:n].copy_(loaded.narrow(0, start, n))
        param.data[n:].zero_()


class QKVParallelLinear(nn.Module):
    """Column-parallel fused [q_r; k_r; v_r]; kv heads are replicated when tp_size > num_kv_heads."""

    def __init__(self, cfg: LlamaConfig, tp_rank: int, tp_size: int):
        super().__init__()
        hd = cfg.head_dim
        if cfg.num_heads % tp_size:
            raise ValueError("num_heads must divide by tp_size")
        if tp_size >= cfg.num_kv_heads:
            if tp_size % cfg.num_kv_heads:
                raise ValueError("tp_size must be a multiple of num_kv_heads")
            kv_heads, kv_shard = 1, tp_rank * cfg.num_kv_heads // tp_size
        else:
            if cfg.num_kv_heads % tp_size:
                raise ValueError("num_kv_heads must divide by tp_size")
            kv_heads, kv_shard = cfg.num_kv_heads // tp_size, tp_rank
        self.q_size = cfg.num_heads // tp_size * hd
        self.kv_size = kv_heads * hd
        self.tp_rank, self.kv_shard = tp_rank, kv_shard
        rows = self.q_size + 2 * self.kv_size
        self.weight = _param(rows, cfg.hidden_size, dtype=cfg.dtype, loader=self.weight_loader)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str) -> None:
        # (offset in the fused param, rows per rank, which shard of the canonical tensor this rank takes)
        slot = {
            "q": (0, self.q_size, self.tp_rank),
            "k": (self.q_size, self.kv_size, self.kv_shard),
            "v": (self.q_size + self.kv_size, self.kv_size, self.kv_shard),
        }[shard_id]
        offset, size, shard = slot
        param.data.narrow(0, offset, size).copy_(loaded.narrow(0, shard * size, size))


class MergedColumnParallelLinear(nn.Module):
    """Column-parallel fused [gate_r; up_r]; shard_id 0 is gate, 1 is up."""

    def __init__(self, hidden: int, inter: int, tp_rank: int, tp_size: int, dtype: torch.dtype):
        super().__init__()
        if inter % tp_size:
            raise ValueError("intermediate_size must divide by tp_size")
        self.shard, self.tp_rank = inter // tp_size, tp_rank
        self.weight = _param(2 * self.shard, hidden, dtype=dtype, loader=self.weight_loader)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int) -> None:
        s = self.shard
        param.data.narrow(0, shard_id * s, s).copy_(loaded.narrow(0, self.tp_rank * s, s))


class RowParallelLinear(nn.Module):
    """Row-parallel (o_proj, down_proj): each rank holds a slice of the input dim (dim 1)."""

    def __init__(self, in_features: int, out_features: int, tp_rank: int, tp_size: int, dtype: torch.dtype):
        super().__init__()
        if in_features % tp_size:
            raise ValueError("in_features must divide by tp_size")
        self.shard, self.tp_rank = in_features // tp_size, tp_rank
        self.weight = _param(out_features, self.shard, dtype=dtype, loader=self.weight_loader)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        param.data.copy_(loaded.narrow(1, self.tp_rank * self.shard, self.shard))


class RMSNorm(nn.Module):
    """Replicated on every rank; loaded by the default loader."""

    def __init__(self, hidden: int, dtype: torch.dtype):
        super().__init__()
        self.weight = _param(hidden, dtype=dtype)


class LlamaAttention(nn.Module):
    def __init__(self, cfg: LlamaConfig, tp_rank: int, tp_size: int):
        super().__init__()
        self.qkv_proj = QKVParallelLinear(cfg, tp_rank, tp_size)
        q_in = cfg.num_heads * cfg.head_dim
        self.o_proj = RowParallelLinear(q_in, cfg.hidden_size, tp_rank, tp_size, cfg.dtype)


class LlamaMLP(nn.Module):
    def __init__(self, cfg: LlamaConfig, tp_rank: int, tp_size: int):
        super().__init__()
        h, i = cfg.hidden_size, cfg.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(h, i, tp_rank, tp_size, cfg.dtype)
        self.down_proj = RowParallelLinear(i, h, tp_rank, tp_size, cfg.dtype)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig, tp_rank: int, tp_size: int):
        super().__init__()
        self.self_attn = LlamaAttention(cfg, tp_rank, tp_size)
        self.mlp = LlamaMLP(cfg, tp_rank, tp_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.dtype)


class RotaryEmbedding(nn.Module):
    """Holds the checkpoint's persistent ``inv_freq`` (F32) as a registered buffer."""

    def __init__(self, head_dim: int):
        super().__init__()
        self.register_buffer("inv_freq", torch.zeros(head_dim // 2, dtype=torch.float32))


class LlamaModel(nn.Module):
    def __init__(self, cfg: LlamaConfig, tp_rank: int, tp_size: int):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp_rank, tp_size, cfg.dtype)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, tp_rank, tp_size) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.dtype)
        self.rotary_emb = RotaryEmbedding(cfg.head_dim)


class VllmLlama(nn.Module):
    """One tensor-parallel rank of a Llama in vLLM's layout; ``load_weights`` takes canonical HF names."""

    def __init__(self, config: LlamaConfig, tp_rank: int = 0, tp_size: int = 1):
        super().__init__()
        self.config, self.tp_rank, self.tp_size = config, tp_rank, tp_size
        self.model = LlamaModel(config, tp_rank, tp_size)
        if config.tie_word_embeddings:
            # Tied: lm_head *is* the embedding, so it has no param of its own (named_parameters dedups it).
            self.lm_head = self.model.embed_tokens
        else:
            self.lm_head = VocabParallelEmbedding(
                config.vocab_size, config.hidden_size, tp_rank, tp_size, config.dtype)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Place each (canonical name, tensor); any subset, any order, any number of calls. Returns params touched."""
        params = dict(self.named_parameters())
        buffers = dict(self.named_buffers())
        loaded: set[str] = set()
        for name, tensor in weights:
            if name in buffers:
                buffers[name].copy_(tensor)
                loaded.add(name)
                continue
            if self.config.tie_word_embeddings and name == "lm_head.weight":
                continue  # the embedding already carries these bits
            for fused, shard_name, shard_id in STACKED_PARAMS_MAPPING:
                if shard_name not in name:
                    continue
                target = name.replace(shard_name, fused)
                param = _lookup(params, target, name)
                param.weight_loader(param, tensor, shard_id)
                break
            else:
                target = name
                param = _lookup(params, target, name)
                getattr(param, "weight_loader", default_weight_loader)(param, tensor)
            loaded.add(target)
        return loaded


def _lookup(params: dict[str, nn.Parameter], target: str, name: str) -> nn.Parameter:
    # Fail loudly: silently skipping an unknown name would turn a refit bug into stale weights.
    if target not in params:
        raise KeyError(f"no param for checkpoint name {name!r}")
    return params[target]


def tp_group(config: LlamaConfig, tp_size: int) -> list[VllmLlama]:
    """One receiver per tensor-parallel rank."""
    return [VllmLlama(config, rank, tp_size) for rank in range(tp_size)]


def canonical_checkpoint(config: LlamaConfig, seed: int) -> dict[str, torch.Tensor]:
    """A seeded checkpoint under Hugging Face names; every tensor except inv_freq depends on the seed."""
    g = torch.Generator().manual_seed(seed)
    dt, h, hd = config.dtype, config.hidden_size, config.head_dim

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * 0.02).to(dt)

    def norm() -> torch.Tensor:
        return (1 + 0.1 * torch.randn(h, generator=g)).to(dt)

    ckpt = {"model.embed_tokens.weight": rand(config.vocab_size, h)}
    for i in range(config.num_layers):
        p = f"model.layers.{i}"
        ckpt[f"{p}.self_attn.q_proj.weight"] = rand(config.num_heads * hd, h)
        ckpt[f"{p}.self_attn.k_proj.weight"] = rand(config.num_kv_heads * hd, h)
        ckpt[f"{p}.self_attn.v_proj.weight"] = rand(config.num_kv_heads * hd, h)
        ckpt[f"{p}.self_attn.o_proj.weight"] = rand(h, config.num_heads * hd)
        ckpt[f"{p}.mlp.gate_proj.weight"] = rand(config.intermediate_size, h)
        ckpt[f"{p}.mlp.up_proj.weight"] = rand(config.intermediate_size, h)
        ckpt[f"{p}.mlp.down_proj.weight"] = rand(h, config.intermediate_size)
        ckpt[f"{p}.input_layernorm.weight"] = norm()
        ckpt[f"{p}.post_attention_layernorm.weight"] = norm()
    ckpt["model.norm.weight"] = norm()
    if not config.tie_word_embeddings:
        ckpt["lm_head.weight"] = rand(config.vocab_size, h)
    ckpt["model.rotary_emb.inv_freq"] = 1.0 / (10000.0 ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
    return ckpt
