"""The small Hugging Face models of dcr_bench (``dcr_bench.models.hf_tiny``)."""

from __future__ import annotations

import pytest

hf_tiny = pytest.importorskip("dcr_bench.models.hf_tiny")
hf_logging = pytest.importorskip("transformers.utils.logging")


def test_a_checkpoint_is_taken_without_printing_anything(capfd):
    """examples/rl_loop.py prints a table row per step: transformers' "Writing model shards" bar,
    drawn by each save, came between every two rows."""
    model = hf_tiny.make_model("llama", "tiny", seed=1)
    capfd.readouterr()
    ck = hf_tiny.checkpoint(model)
    assert "model.embed_tokens.weight" in ck
    assert capfd.readouterr() == ("", "")
    assert hf_logging.is_progress_bar_enabled()  # the caller's setting is left as it was
