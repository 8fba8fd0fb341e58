"""The vLLM receiver's layer map and engine fingerprint, on this repository's vLLM-style model (no vLLM
needed; tests/vllm runs the same code against real engines)."""

from __future__ import annotations

import torch

from dcr_bench.models.llama_vllm import LlamaConfig, VllmLlama, canonical_checkpoint
from flows.receive import held_digests, layer_probe, live_tensors


def _schema(ck):
    return [(n, "BF16", tuple(t.shape)) for n, t in ck.items()]


def test_the_layer_map_follows_the_loader_and_writes_nothing():
    cfg = LlamaConfig()
    model = VllmLlama(cfg)
    ck = canonical_checkpoint(cfg, seed=0)
    model.load_weights(list(ck.items()))
    before = held_digests.fingerprint(model)
    loaders = {id(p): getattr(p, "weight_loader", None) for p in model.parameters()}
    lm = layer_probe.probe_layers(model, _schema(ck))
    assert held_digests.fingerprint(model) == before  # meta probes, recorders: nothing written
    assert {id(p): getattr(p, "weight_loader", None) for p in model.parameters()} == loaders  # loaders restored
    assert lm.layers["model.layers.0.self_attn.q_proj.weight"] == {"model.layers.0.self_attn.qkv_proj"}
    assert lm.layers["model.layers.1.mlp.up_proj.weight"] == {"model.layers.1.mlp.gate_up_proj"}
    # one changed q: its fused layer is reloaded whole (q, k and v), nothing else
    assert lm.reload_set(["model.layers.0.self_attn.q_proj.weight"]) == [
        "model.layers.0.self_attn.k_proj.weight", "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.v_proj.weight"]
    assert lm.reload_set([]) == []
    # a name the loader refuses (or does not know) may feed anything: a full reload
    assert layer_probe.probe_layers(model, [("no.such.weight", "BF16", (2,))]).reload_set(["no.such.weight"]) is None
    assert lm.reload_set(["not.in.the.schema"]) is None


def test_the_fingerprint_sees_parameters_kept_tensors_and_kernels():
    cfg = LlamaConfig()
    model = VllmLlama(cfg)
    model.load_weights(list(canonical_checkpoint(cfg, seed=0).items()))
    fp = held_digests.fingerprint(model)
    norm = model.get_submodule("model.norm").weight
    norm.data.view(torch.int16)[0] ^= 1
    assert held_digests.fingerprint(model) != fp
    norm.data.view(torch.int16)[0] ^= 1
    assert held_digests.fingerprint(model) == fp
    # a repacked kernel: the weight lives only in the closure of cpu_linear (as vLLM's CPU backend does)
    layer = model.get_submodule("model.layers.0.mlp.down_proj")
    packed = layer.weight.detach().clone()
    layer.input_size_per_partition = packed.shape[1]
    layer.params_dtype = packed.dtype
    layer.cpu_linear = lambda x, weight, bias: torch.nn.functional.linear(x, packed, bias)
    with_kernel = held_digests.fingerprint(model)
    dump = live_tensors.dump(model)
    assert "model.layers.0.mlp.down_proj<kernel>" in dump and "model.layers.0.mlp.down_proj.<closure>cpu_linear.packed" in dump
    packed.view(-1)[5] += 1
    assert held_digests.fingerprint(model) != with_kernel
    assert live_tensors.dump(model)["model.layers.0.mlp.down_proj<kernel>"] != dump["model.layers.0.mlp.down_proj<kernel>"]


def _special_bits(t: torch.Tensor) -> torch.Tensor:
    """``t`` (BF16) with NaNs of distinct payloads, a -0.0 for a +0.0, infinities and a subnormal."""
    bits = t.clone().view(torch.int16).reshape(-1)
    specials = [0x7FC1, 0x7F81, -0x3F, 0x7F80, -0x80, 0x0001, -0x7FFF, 0]  # NaNs, -0.0, +-inf, subnormals, +0.0
    bits[: len(specials)] = torch.tensor(specials, dtype=torch.int16)
    return bits.view(torch.bfloat16).reshape(t.shape)


def test_layers_that_keep_the_checkpoints_layout_are_patched_in_place_element_for_element():
    from flows.receive import param_patch

    cfg = LlamaConfig(tie_word_embeddings=True)
    model = VllmLlama(cfg)
    held = canonical_checkpoint(cfg, seed=0)
    held["model.norm.weight"] = _special_bits(held["model.norm.weight"])
    model.load_weights(list(held.items()))
    lm = layer_probe.probe_layers(model, _schema(held))
    patchable = param_patch.candidates(model, lm)
    # norms and the unfused row-parallel projections are copied as they are; fused layers (a shard id)
    # and the tied embedding (two modules hold it) are not patchable
    assert patchable["model.norm.weight"] == "model.norm.weight"
    assert patchable["model.layers.1.self_attn.o_proj.weight"] == "model.layers.1.self_attn.o_proj.weight"
    assert "model.layers.0.self_attn.q_proj.weight" not in patchable and "model.embed_tokens.weight" not in patchable
    # a kernel (a repacked copy) takes a module out
    layer = model.get_submodule("model.layers.0.mlp.down_proj")
    layer.input_size_per_partition, layer.params_dtype = layer.weight.shape[1], layer.weight.dtype
    layer.cpu_linear = lambda x, weight, bias: torch.nn.functional.linear(x, weight, bias)
    assert "model.layers.0.mlp.down_proj.weight" not in param_patch.candidates(model, lm)
    del layer.cpu_linear

    target = dict(held)
    norm = target["model.norm.weight"].clone().view(torch.int16)
    norm[0] = 0x7FC2  # a NaN's payload changes: only the bits say so
    norm[1] = 0  # -0.0 -> +0.0
    norm[9] ^= 1
    target["model.norm.weight"] = norm.view(torch.bfloat16)
    changed = ["model.norm.weight", "model.layers.0.self_attn.q_proj.weight"]
    patch, reload = param_patch.split(changed, patchable, lm)
    assert patch == ["model.norm.weight"] and "model.layers.0.self_attn.k_proj.weight" in reload

    def bits(ck):
        return lambda n: ck[n]

    before = held_digests.digests_of(model)
    patches = param_patch.prepare(model, patchable, patch, bits(held), bits(target))
    assert [p.elements for p in patches] == [3] and held_digests.digests_of(model) == before  # prepare writes nothing
    assert param_patch.apply(patches) == 3
    got = model.get_submodule("model.norm").weight
    assert torch.equal(got.view(torch.int16), target["model.norm.weight"].view(torch.int16))
    after = held_digests.digests_of(model)
    assert {k for k in after if after[k] != before[k]} == {"model.norm"}
    param_patch.undo(patches)
    assert held_digests.digests_of(model) == before
    # a parameter that does not hold the held step's bytes is not patched: its layer is reloaded
    got.data.view(torch.int16)[5] ^= 1
    assert param_patch.prepare(model, patchable, patch, bits(held), bits(target)) is None
    got.data.view(torch.int16)[5] ^= 1


def test_an_engine_in_another_dtype_is_patched_as_its_loader_converts():
    """A BF16 checkpoint in a float32 engine (as the vLLM tests run): the patch writes the target
    converted as the loader's copy converts it, NaN payloads and signed zeros included."""
    from flows.receive import param_patch

    cfg = LlamaConfig()
    model = VllmLlama(cfg).to(torch.float32)
    held = canonical_checkpoint(cfg, seed=0)
    held["model.norm.weight"] = _special_bits(held["model.norm.weight"])
    model.load_weights(list(held.items()))
    lm = layer_probe.probe_layers(model, _schema(held))
    patchable = param_patch.candidates(model, lm)
    assert "model.norm.weight" in patchable
    target = dict(held)
    norm = target["model.norm.weight"].clone().view(torch.int16)
    norm[0], norm[1], norm[20] = 0x7FC3, 0, norm[20] ^ 1
    target["model.norm.weight"] = norm.view(torch.bfloat16)
    patches = param_patch.prepare(model, patchable, ["model.norm.weight"], held.__getitem__, target.__getitem__)
    assert param_patch.apply(patches) == 3
    reference = VllmLlama(cfg).to(torch.float32)
    reference.load_weights(list(target.items()))  # what a reload of the target gives
    assert torch.equal(model.get_submodule("model.norm").weight.view(torch.int32),
                       reference.get_submodule("model.norm").weight.view(torch.int32))
