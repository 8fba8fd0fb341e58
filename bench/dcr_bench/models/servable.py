"""``python -m dcr_bench.models.servable --out DIR``: a model directory a vLLM server starts on, written
offline (nothing downloaded).

``DIR`` gets what ``--model DIR`` needs: ``config.json`` and ``generation_config.json``, a tokenizer
(``tokenizer.json`` and ``tokenizer_config.json``: byte-level, one token per byte and ``<s>``,
``</s>``, no merges, so any text encodes; unused tokens fill the model's vocabulary), and ``model.safetensors``: the BF16 weights of a
randomly initialised model of ``dcr_bench.models.hf_tiny`` (``--kind``, ``--size``, ``--seed``), one
file, as ``save_pretrained`` writes it. Publish that file as a step (``dcr publish ROOT
DIR/model.safetensors --step 0``) and start servers on ``DIR``: docs/guides/vllm-fleets.md. Needs
``transformers`` and ``tokenizers`` (the ``dev`` extra, or vLLM's own), no vLLM.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from dcr_bench.models import hf_tiny

BOS, EOS = "<s>", "</s>"
FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors")


def byte_tokenizer(vocab_size: int):
    """A byte-level tokenizer of ``vocab_size`` tokens: the 256 bytes (as ``tokenizers``' byte-level
    alphabet, sorted), ``<s>`` and ``</s>``, then ``<unused_K>`` up to the model's vocabulary (text
    never encodes to those, but a random model generates them, and they decode as themselves)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab.update({BOS: len(vocab), EOS: len(vocab) + 1})
    if vocab_size < len(vocab):
        raise ValueError(f"a vocabulary of {vocab_size} is smaller than the {len(vocab)} tokens of the bytes and <s>, </s>")
    vocab.update({f"<unused_{k}>": len(vocab) + k for k in range(vocab_size - len(vocab))})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([BOS, EOS])
    return tok


def write(out: str | os.PathLike, kind: str = "llama", size: str = "tiny", seed: int = 0) -> list[str]:
    """Write the model directory ``out`` (created; it must not hold anything yet); its files."""
    out = os.fspath(out)
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        raise FileExistsError(f"{out}: exists and is not an empty directory; name a new one")
    model = hf_tiny.make_model(kind, size, seed=seed)
    tok = byte_tokenizer(model.config.vocab_size)
    bos, eos = tok.token_to_id(BOS), tok.token_to_id(EOS)
    for cfg in (model.config, model.generation_config):
        cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id = bos, eos, None
    os.makedirs(out, exist_ok=True)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one line of output, not a bar
    model.save_pretrained(out, safe_serialization=True, max_shard_size="100GB")  # config, weights in one file
    tok.save(os.path.join(out, "tokenizer.json"))
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": EOS,
                   "model_max_length": model.config.max_position_embeddings}, f, indent=2)
    missing = [name for name in FILES if not os.path.isfile(os.path.join(out, name))]
    if missing:
        raise RuntimeError(f"{out}: {', '.join(missing)} not written (a transformers release that saves differently)")
    return [os.path.join(out, name) for name in FILES]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dcr_bench.models.servable", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, metavar="DIR", help="the model directory to write (new or empty)")
    p.add_argument("--kind", choices=hf_tiny.KINDS, default="llama", help="the model (default: llama)")
    p.add_argument("--size", choices=sorted(hf_tiny.SIZES), default="tiny",
                   help="tiny (0.4M parameters, default), small, medium (124M), large (0.85B)")
    p.add_argument("--seed", type=int, default=0, help="the weights' random seed (default 0)")
    args = p.parse_args(argv)
    try:
        files = write(args.out, args.kind, args.size, args.seed)
    except (OSError, ValueError, RuntimeError, ImportError) as e:
        print(f"servable: error: {e}", file=sys.stderr)
        return 2 if isinstance(e, (FileExistsError, ValueError)) else 1
    size = sum(os.path.getsize(f) for f in files)
    print(f"{args.out}: {args.kind} ({args.size}), {len(files)} files, {size / 1e6:.1f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
