"""Small Hugging Face models created from configs (no download) and trained for real AdamW BF16 steps:
the checkpoints that the vLLM receiver tests and ``dcr_bench.vllm_refit`` publish and serve.

Kinds: ``llama`` (GQA, untied embeddings), ``llama-tied`` (tied embeddings), ``mixtral`` (a MoE:
4 experts, 2 per token). ``size`` scales hidden width and depth (``tiny``: hidden 128, 2 layers;
``small``: hidden 512, 4 layers; ``medium``: hidden 1024, 8 layers, 124M parameters; ``large``:
hidden 2048, 16 layers, 0.85B parameters).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator

import torch

SIZES = {  # hidden, layers, heads, kv heads, intermediate, vocab
    "tiny": (128, 2, 4, 2, 256, 512),
    "small": (512, 4, 8, 4, 1408, 4096),
    "medium": (1024, 8, 16, 4, 2816, 16384),
    "large": (2048, 16, 16, 4, 5632, 32000),
}
KINDS = ("llama", "llama-tied", "mixtral")


def each_model(models: str, prefix: str) -> Iterator[tuple[str, str, str]]:
    """``(kind, size, directory)`` for each ``KIND:SIZE`` of the comma-separated ``models`` (size
    tiny when left out), with a fresh temp directory (``prefix``) removed once the loop moves on."""
    for spec in models.split(","):
        kind, _, size = spec.partition(":")
        with tempfile.TemporaryDirectory(prefix=prefix) as base:
            yield kind, size or "tiny", base


def make_model(kind: str, size: str = "tiny", seed: int = 0):
    """A randomly initialised BF16 model of ``kind`` (see the module docstring)."""
    import transformers as tf

    if kind not in KINDS or size not in SIZES:
        raise ValueError(f"kind must be one of {KINDS} and size one of {sorted(SIZES)}, got {kind!r}, {size!r}")
    hidden, layers, heads, kv, inter, vocab = SIZES[size]
    common = dict(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                  num_key_value_heads=kv, max_position_embeddings=512)
    torch.manual_seed(seed)
    if kind == "mixtral":
        cfg = tf.MixtralConfig(intermediate_size=inter // 2, num_local_experts=4, num_experts_per_tok=2, **common)
        model = tf.MixtralForCausalLM(cfg)
    else:
        cfg = tf.LlamaConfig(intermediate_size=inter, tie_word_embeddings=kind == "llama-tied", **common)
        model = tf.LlamaForCausalLM(cfg)
    return model.to(torch.bfloat16)


def save_config(model, directory: str | os.PathLike) -> None:
    """The model's ``config.json`` and ``generation_config.json`` (no weights) into ``directory``."""
    os.makedirs(directory, exist_ok=True)
    model.config.architectures = [type(model).__name__]  # what vLLM resolves the model class from
    model.config.save_pretrained(directory)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(directory)


def checkpoint(model) -> dict[str, torch.Tensor]:
    """The model's checkpoint exactly as ``save_pretrained`` writes it: transformers converts some
    in-memory layouts on save (Mixtral's fused experts go back to one tensor per expert), and a tied
    ``lm_head.weight`` is left out. That is the format vLLM loads. transformers' progress bar for
    the write is kept off: a caller that prints a line per step (examples/rl_loop.py) would get a
    bar between every two."""
    from safetensors.torch import load_file
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        with tempfile.TemporaryDirectory() as d:
            model.save_pretrained(d, safe_serialization=True, max_shard_size="100GB")
            return load_file(os.path.join(d, "model.safetensors"))
    finally:
        if bars:
            hf_logging.enable_progress_bar()


def train(model, steps: int, lr: float = 3e-5, batch: int = 4, seq: int = 32, seed: int = 0) -> Iterator[dict]:
    """Yield the checkpoint after each of ``steps`` AdamW steps (BF16 parameters, random token data)."""
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    vocab = model.config.vocab_size
    model.train()
    for _ in range(steps):
        ids = torch.randint(0, vocab, (batch, seq), generator=g)
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        yield checkpoint(model)
