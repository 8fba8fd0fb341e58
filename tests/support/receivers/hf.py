"""A Hugging Face receiver: a tiny transformers Llama that places weights through its own load_state_dict."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM


def tiny_config(tie: bool = False) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tie,
        # pad=0 silences generate's warning; no eos, so greedy decoding always runs the full n steps.
        pad_token_id=0, bos_token_id=1, eos_token_id=None,
        attn_implementation="eager",
    )


def tiny_hf_llama(seed: int = 0, tie: bool = False) -> LlamaForCausalLM:
    """A seeded bf16 LlamaForCausalLM from config (no download); norms are perturbed so they depend on the seed."""
    # fork_rng: HF's init draws from the global RNG; don't disturb the caller's stream.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(tiny_config(tie))
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.add_(0.1 * torch.randn_like(p))
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.to(torch.bfloat16).eval()


def _unwrap(model: nn.Module) -> nn.Module:
    return model.model if isinstance(model, HFReceiver) else model


def canonical_checkpoint(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict, cloned (persistent buffers included exactly as the state dict defines them)."""
    return {k: v.clone() for k, v in _unwrap(model).state_dict().items()}


class HFReceiver(nn.Module):
    """Wraps a transformers model; ``load_weights`` goes through the model's own ``load_state_dict``."""

    def __init__(self, model: nn.Module | None = None, *, seed: int = 0, tie: bool = False):
        super().__init__()
        self.model = model if model is not None else tiny_hf_llama(seed, tie)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load any subset of names; an unknown name raises (strict=False only tolerates *missing* keys)."""
        state = dict(weights)
        result = self.model.load_state_dict(state, strict=False)
        if result.unexpected_keys:
            raise KeyError(f"unexpected keys: {sorted(result.unexpected_keys)}")
        return set(state)


@torch.no_grad()
def greedy_tokens(model: nn.Module, prompt_ids: Sequence[int] | torch.Tensor, n: int) -> list[int]:
    """The n tokens greedy decoding appends to the prompt."""
    model = _unwrap(model)
    ids = torch.as_tensor(prompt_ids, dtype=torch.long).reshape(1, -1)
    out = model.generate(
        input_ids=ids, attention_mask=torch.ones_like(ids),
        do_sample=False, max_new_tokens=n, min_new_tokens=n,
    )
    return out[0, ids.shape[1]:].tolist()
