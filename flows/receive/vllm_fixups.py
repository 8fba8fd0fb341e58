"""Where vLLM's in-place reload (0.32) does not give what a fresh load gives, and what DCR does about it.

Both were found by comparing a refitted engine with a fresh one, byte for byte
(``tests/vllm/test_vllm_engine.py``); both leave an engine that serves without error, with weights
that are not the step's:

1. **Tied parameters** (a tied ``lm_head`` and ``embed_tokens``): the reload processes a shared
   parameter in its first owner only (a limitation vLLM documents in
   ``model_loader/reload/__init__.py``), so the kernel the tied ``lm_head`` built from it (its
   repacked ``cpu_linear`` on CPU) keeps computing with the old weights. After the reload, DCR runs
   ``quant_method.process_weights_after_loading`` of every such module (``after_reload``).
2. **MoE experts on CPU**: ``UnquantizedFusedMoEMethod._setup_kernel`` treats a second processing as
   a weight update (``moe_kernel`` already set) and then skips the experts' own
   ``process_weights_after_loading``, which on CPU prepacks ``w13_weight`` and ``w2_weight`` into
   the grouped-GEMM layout: the reloaded experts hold unpacked weights that the kernel reads as
   packed. Before the reload, DCR clears ``moe_kernel`` of the layers it reloads
   (``before_reload``), so their processing takes the first-load path (kernel built, weights
   prepacked), the same code a fresh engine ran.

A third case is DCR's own: a reload that fails midway (an exception in a layer's processing, say)
leaves that layer holding its half-processed, checkpoint-shaped tensors in place of its kernel
tensors, and the next reload would take those for the kernel's. ``abandon_reload`` puts every
unfinished layer's own kernel tensors back (their contents are only written after processing
succeeds) before vLLM's ``finalize_layerwise_reload`` closes the reload, so the rollback's reload
starts from the engine's real tensors.

``reload`` and ``abandon`` wrap vLLM's reload with these fixes: what both of DCR's vLLM adapters
(``vllm_worker.VllmWorker``, ``vllm_transfer.VllmEngineModel``) give the engine-independent code as
their ``EngineModel.reload`` and ``abandon_reload``.

A vLLM upgrade may fix or change any of these; the exactness tests say which.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from flows.receive.layer_probe import tied_followers


def _layers(model: torch.nn.Module, layers: set[str] | None):
    for name, mod in model.named_modules():
        if layers is None or name in layers:
            yield name, mod


def before_reload(model: torch.nn.Module, layers: set[str] | None) -> list[str]:
    """Make the reloaded layers' processing take vLLM's first-load path (fix 2); returns their names."""
    reset = []
    for name, mod in _layers(model, layers):
        method = getattr(mod, "quant_method", None)
        if getattr(method, "moe_kernel", None) is not None:
            method.moe_kernel = None
            reset.append(name)
    return reset


def after_reload(model: torch.nn.Module, layers: set[str] | None) -> list[str]:
    """Process the modules tied to a reloaded layer (fix 1); returns their names."""
    done = []
    for name, mod in tied_followers(model, layers):
        method = getattr(mod, "quant_method", None)
        if callable(getattr(method, "process_weights_after_loading", None)):
            method.process_weights_after_loading(mod)
            done.append(name)
    return done


def abandon_reload(model: torch.nn.Module, model_config) -> None:
    """Close a reload cut off by an exception (see the module docstring); vLLM 0.32 internals."""
    from vllm.model_executor.layers.attention import is_deferred_attention_layer  # noqa: PLC0415 - in a vLLM worker
    from vllm.model_executor.model_loader.reload import layerwise  # noqa: PLC0415 - in a vLLM worker

    for layer in model.modules():
        info = layerwise.LAYERWISE_INFO.get(layer)
        if info is None or not info.can_load() or info.kernel_tensors is None or is_deferred_attention_layer(layer):
            continue
        layerwise._place_kernel_tensors(layer, info)
        info.reset()
    layerwise.finalize_layerwise_reload(model, model_config)


def reload(model: torch.nn.Module, vllm_config, layers: set[str] | None,
           reload_weights: Callable[[], None]) -> None:
    """vLLM's in-place reload (``reload_weights()``) of ``layers`` (None: all), with fixes 1 and 2."""
    before_reload(model, layers)
    reload_weights()
    with current_config(vllm_config):
        after_reload(model, layers)


def abandon(model: torch.nn.Module, vllm_config, model_config) -> None:
    """Close a reload cut off by an exception (fix 3)."""
    with current_config(vllm_config):
        abandon_reload(model, model_config)


def current_config(vllm_config):
    """vLLM's loaders read the current config; its worker methods set it (``set_current_vllm_config``)."""
    from vllm.config import set_current_vllm_config  # noqa: PLC0415 - in a vLLM process

    return set_current_vllm_config(vllm_config)
