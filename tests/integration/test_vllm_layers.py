"""The vLLM receiver's layer map and engine fingerprint, on this repository's vLLM-style model (no vLLM
needed; tests/vllm runs the same code against real engines)."""

from __future__ import annotations

import torch

from dcr_bench.models.llama_vllm import LlamaConfig, VllmLlama, canonical_checkpoint
from flows.receive import vllm_layers, vllm_state


def _schema(ck):
    return [(n, "BF16", tuple(t.shape)) for n, t in ck.items()]


def test_the_layer_map_follows_the_loader_and_writes_nothing():
    cfg = LlamaConfig()
    model = VllmLlama(cfg)
    ck = canonical_checkpoint(cfg, seed=0)
    model.load_weights(list(ck.items()))
    before = vllm_state.fingerprint(model)
    loaders = {id(p): getattr(p, "weight_loader", None) for p in model.parameters()}
    lm = vllm_layers.probe_layers(model, _schema(ck))
    assert vllm_state.fingerprint(model) == before  # meta probes, recorders: nothing written
    assert {id(p): getattr(p, "weight_loader", None) for p in model.parameters()} == loaders  # loaders restored
    assert lm.layers["model.layers.0.self_attn.q_proj.weight"] == {"model.layers.0.self_attn.qkv_proj"}
    assert lm.layers["model.layers.1.mlp.up_proj.weight"] == {"model.layers.1.mlp.gate_up_proj"}
    # one changed q: its fused layer is reloaded whole (q, k and v), nothing else
    assert lm.reload_set(["model.layers.0.self_attn.q_proj.weight"]) == [
        "model.layers.0.self_attn.k_proj.weight", "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.v_proj.weight"]
    assert lm.reload_set([]) == []
    # a name the loader refuses (or does not know) may feed anything: a full reload
    assert vllm_layers.probe_layers(model, [("no.such.weight", "BF16", (2,))]).reload_set(["no.such.weight"]) is None
    assert lm.reload_set(["not.in.the.schema"]) is None


def test_the_fingerprint_sees_parameters_kept_tensors_and_kernels():
    cfg = LlamaConfig()
    model = VllmLlama(cfg)
    model.load_weights(list(canonical_checkpoint(cfg, seed=0).items()))
    fp = vllm_state.fingerprint(model)
    norm = model.get_submodule("model.norm").weight
    norm.data.view(torch.int16)[0] ^= 1
    assert vllm_state.fingerprint(model) != fp
    norm.data.view(torch.int16)[0] ^= 1
    assert vllm_state.fingerprint(model) == fp
    # a repacked kernel: the weight lives only in the closure of cpu_linear (as vLLM's CPU backend does)
    layer = model.get_submodule("model.layers.0.mlp.down_proj")
    packed = layer.weight.detach().clone()
    layer.input_size_per_partition = packed.shape[1]
    layer.params_dtype = packed.dtype
    layer.cpu_linear = lambda x, weight, bias: torch.nn.functional.linear(x, packed, bias)
    with_kernel = vllm_state.fingerprint(model)
    dump = vllm_state.dump(model)
    assert "model.layers.0.mlp.down_proj<kernel>" in dump and "model.layers.0.mlp.down_proj.<closure>cpu_linear.packed" in dump
    packed.view(-1)[5] += 1
    assert vllm_state.fingerprint(model) != with_kernel
    assert vllm_state.dump(model)["model.layers.0.mlp.down_proj<kernel>"] != dump["model.layers.0.mlp.down_proj<kernel>"]
