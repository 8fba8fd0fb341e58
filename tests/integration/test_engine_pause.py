"""An engine's pause window (``flows.receive.engine_apply``) on a vLLM-style model with the model's
own ``load_weights`` as its reload (DCR's engine receiver, no vLLM): what the pause reads of the
engine, what it refuses, and the digests taken once the engine serves again.

- In the pause, only the modules patched in place are hashed in full; every module is stamped
  (sampled blocks); the touched modules' bytes are hashed after it (``settle``), in a thread.
- Another reload of the engine between the prepare and the pause is refused, nothing applied; a
  write to a layer the apply reloads whole is overwritten (the layer does not depend on what it
  held); a write to a module patched in place is refused.
- A reload by anyone else right after the pause, before the digests are taken, leaves the engine
  unknown: the next refit loads it whole, exactly.
- The prepare drops the old mirror's pages from the page cache; a reload that dies halfway is
  rolled back from that mirror, read from disk, to the engine's old bits.
- With repacked kernels (``KernelEngine``: opaque handles, as vLLM's CPU backend builds): the pause
  and the digests after it run no kernel; the next prepare (or a status call) reads them back and
  completes the record, exactly; a kernel rebuilt by anyone else in between, its module's tensors
  untouched, leaves the engine unknown and the next refit loads it whole.
"""

from __future__ import annotations

import threading

import pytest
import torch

from dcr_bench.models.llama_vllm import LlamaConfig, VllmLlama, canonical_checkpoint
from dcr_core.errors import StateMismatchError
from flows import run_publish
from flows.options import PublishOptions
from flows.receive import engine_apply, held_digests, live_tensors
from flows.receive.engine import EngineReceiver
from flows.receive.receiver import Binding
from storage.root import RootRef
from tests.support import page_cache
from tests.support.helpers import assert_bits_equal, dtype_name, nasty_tensor
from tests.support.loader_engine import KernelEngine, LoaderEngine, linear_layers, repack

NORM = "model.layers.1.input_layernorm.weight"
EMB = "model.embed_tokens.weight"
Q = "model.layers.0.self_attn.q_proj.weight"


def _steps() -> tuple[LlamaConfig, list[dict[str, torch.Tensor]]]:
    """Step 0; step 1: every weight new except the norms, one norm changed in one element (a patch),
    the embedding full of NaNs with payloads, signed zeros, infinities and subnormals; step 2: new again."""
    cfg = LlamaConfig()
    cks = [{n: t for n, t in canonical_checkpoint(cfg, seed=s).items() if not n.endswith("inv_freq")} for s in range(3)]
    for s in (1, 2):
        for n in cks[s]:
            if "norm" in n:
                cks[s][n] = cks[0][n].clone()
    cks[1][NORM].view(torch.int16)[3] ^= 1
    emb = cks[0][EMB]
    cks[1][EMB] = nasty_tensor(dtype_name(emb), tuple(emb.shape), seed=1)
    return cfg, cks


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    cfg, cks = _steps()
    root = str(tmp_path_factory.mktemp("pause") / "bucket")
    opts = PublishOptions(chunk_bytes=4096, cache_dir=str(tmp_path_factory.mktemp("cache")))
    for s, ck in enumerate(cks):
        run_publish(root, ck, s, options=opts)
    return cfg, cks, root


def _loaded(cfg, ck) -> VllmLlama:
    """A fresh model loaded with ``ck``: the dense reference."""
    m = VllmLlama(cfg)
    m.load_weights(list(ck.items()))
    return m


def _dense(cfg, ck) -> dict[str, torch.Tensor]:
    return dict(_loaded(cfg, ck).state_dict())


def _worker(cfg, cks, root, tmp_path, engine=LoaderEngine) -> tuple[VllmLlama, EngineReceiver]:
    model = VllmLlama(cfg)
    model.load_weights(list(cks[0].items()))
    worker = EngineReceiver(engine(model))
    worker.bind(Binding(RootRef(root), "pause", mirror=str(tmp_path / "mirror.safetensors")))
    assert worker.refit(0).step == 0  # known from now on
    worker.wait()
    return model, worker


def test_the_pause_hashes_only_the_patched_modules_and_the_rest_is_hashed_once_it_serves(chain, tmp_path, monkeypatch):
    cfg, cks, root = chain
    model, worker = _worker(cfg, cks, root, tmp_path)
    hashed: list[tuple[str, str]] = []  # (module, thread)
    real = held_digests.module_digest

    def counted(name, mod, probe=None):
        hashed.append((name, threading.current_thread().name))
        return real(name, mod, probe)

    monkeypatch.setattr(held_digests, "module_digest", counted)
    worker.prepare(1)
    patched = engine_apply.patched_modules(model, worker._prepared)
    hashed.clear()
    worker.apply()
    in_pause = {n for n, thread in hashed if thread != "dcr-settle"}
    worker.record()
    worker.wait()
    r = worker.last.model_dump()
    assert r["mode"] == "delta" and r["patched_tensors"] and r["reloaded_tensors"], r
    assert "model.layers.1.input_layernorm" in patched and "model.embed_tokens" not in patched
    assert in_pause == patched, "the pause hashes only the modules it patches"
    settled = {n for n, thread in hashed if thread == "dcr-settle"}
    assert {"model.embed_tokens", "model.layers.0.self_attn.qkv_proj", *patched} <= settled
    assert_bits_equal(dict(model.state_dict()), _dense(cfg, cks[1]))
    status = worker.status()
    assert status["known"] and status["held"]["step"] == 1
    assert status["held"]["fingerprint"] == held_digests.fingerprint(model), "the digests taken after the pause are exact"
    assert worker.refit(2).details["mode"] == "delta"  # what the settled digests say, the next prepare finds
    assert_bits_equal(dict(model.state_dict()), _dense(cfg, cks[2]))


@pytest.mark.faults(component="engine receiver", outcome="the engine reloaded by someone else between the prepare and the pause: the pause's stamps see it, nothing is applied (StateMismatchError), and the next refit loads the engine whole, exactly")
def test_a_reload_between_the_prepare_and_the_pause_is_refused_and_nothing_is_applied(chain, tmp_path):
    cfg, cks, root = chain
    model, worker = _worker(cfg, cks, root, tmp_path)
    worker.prepare(1)
    model.load_weights(list(cks[2].items()))  # another reload, not DCR's
    with pytest.raises(StateMismatchError, match="changed since dcr_prepare"):
        worker.apply()
    worker.release()
    assert_bits_equal(dict(model.state_dict()), _dense(cfg, cks[2]))
    assert worker.refit(1).details["mode"] == "full"
    assert_bits_equal(dict(model.state_dict()), _dense(cfg, cks[1]))


@pytest.mark.faults(component="engine receiver", outcome="one element written by someone else between the prepare and the pause: in a module patched in place, refused (its full digest), nothing applied; in a layer reloaded whole, overwritten: the engine equals the step and its record is exact")
@pytest.mark.parametrize("where", ["patched", "reloaded"])
def test_one_element_written_before_the_pause(chain, tmp_path, where):
    cfg, cks, root = chain
    model, worker = _worker(cfg, cks, root, tmp_path)
    worker.prepare(1)
    module = "model.layers.1.input_layernorm" if where == "patched" else "model.layers.0.self_attn.qkv_proj"
    w = model.get_submodule(module).weight
    w.data.view(-1).view(torch.int16)[w.numel() // 2 + 1] ^= 1 << 3  # through .data: no version bump
    if where == "patched":
        with pytest.raises(StateMismatchError, match="changed since dcr_prepare"):
            worker.apply()
        worker.release()
        return
    worker.apply()
    worker.record()
    worker.release()
    assert_bits_equal(dict(model.state_dict()), _dense(cfg, cks[1]))
    assert worker.status()["known"]


@pytest.mark.faults(component="engine receiver", outcome="the engine reloaded by someone else right after the pause, before the digests for the record were taken: their stamps see it, the engine is unknown, and the next refit loads it whole, exactly")
def test_a_reload_right_after_the_pause_leaves_the_engine_unknown(chain, tmp_path, monkeypatch):
    cfg, cks, root = chain
    model, worker = _worker(cfg, cks, root, tmp_path)
    real = engine_apply.settle
    landed = []

    def foreign_reload_first(*args):
        model.load_weights(list(cks[2].items()))
        landed.append(True)
        return real(*args)

    monkeypatch.setattr(engine_apply, "settle", foreign_reload_first)
    worker.refit(1)
    assert worker.wait() is None and landed, "the engine is unknown once its digests saw the other reload"
    monkeypatch.setattr(engine_apply, "settle", real)
    assert worker.refit(1).details["mode"] == "full"
    assert_bits_equal(dict(model.state_dict()), _dense(cfg, cks[1]))
    assert worker.status()["known"]


def test_the_prepare_drops_the_old_mirrors_pages_and_a_failed_reload_rolls_back_from_disk(chain, tmp_path):
    """The old mirror is read again only by a failed apply's roll-back: the prepare drops its pages
    from the page cache (the pause's reload then has the memory), and that roll-back, reading it back
    from disk, still gives the engine its old bits."""
    if not page_cache.drops_pages(str(tmp_path)):
        pytest.skip(f"{tmp_path} is on a file system that keeps its pages")
    cfg, cks, root = chain
    model, worker = _worker(cfg, cks, root, tmp_path)
    mirror = str(tmp_path / "mirror.safetensors")
    with open(mirror, "rb") as f:
        f.read()
    assert page_cache.resident_pages(mirror) > 0
    worker.prepare(1)
    staged = worker._prepared.staged.path
    assert page_cache.resident_pages(mirror) == 0, "the old mirror's pages were dropped by the prepare"
    assert page_cache.resident_pages(staged) > 0, "the staged mirror's were kept for the pause"
    real, calls = worker.engine.reload, []

    def half_then_fail(weights, layers):  # the apply's reload dies halfway; the roll-back's succeeds
        calls.append(layers)
        if len(calls) == 1:
            weights = list(weights)
            real(weights[: len(weights) // 2], layers)
            raise RuntimeError("reload died halfway")
        return real(weights, layers)

    worker.engine.reload = half_then_fail
    with pytest.raises(RuntimeError, match="died halfway"):
        worker.apply()
    assert len(calls) == 2, "the roll-back reloaded from the old mirror"
    assert_bits_equal(dict(model.state_dict()), _dense(cfg, cks[0]))
    worker.engine.reload = real
    assert worker.refit(1).step == 1
    assert_bits_equal(dict(model.state_dict()), _dense(cfg, cks[1]))


def _kernels(model) -> dict[str, torch.Tensor]:
    """Every kernel's weights, read back through the kernel (``live_tensors.readback``), as bytes."""
    return {n: torch.from_numpy(b) for n, b in live_tensors.readback(model).items()}


def _dense_kernels(cfg, ck) -> dict[str, torch.Tensor]:
    return _kernels(KernelEngine(_loaded(cfg, ck)).model)


def test_with_kernels_the_pause_runs_none_and_the_next_prepare_completes_the_record(chain, tmp_path, monkeypatch):
    cfg, cks, root = chain
    model, worker = _worker(cfg, cks, root, tmp_path, KernelEngine)
    assert linear_layers(model)
    probed: list[tuple[str, str]] = []  # (module input size, thread)
    real = held_digests.kernel_probe

    def counted(mod):
        probed.append((mod.input_size_per_partition, threading.current_thread().name))
        return real(mod)

    monkeypatch.setattr(held_digests, "kernel_probe", counted)
    worker.prepare(1)
    assert len(probed) == len(linear_layers(model)), "the prepare reads every kernel back"
    probed.clear()
    worker.apply()
    worker.record()
    worker.wait()
    assert probed == [], "neither the pause nor the digests after it run a kernel"
    held = worker.known.held
    assert held["step"] == 1 and held["fingerprint"] is None and held_digests.pending(held["digests"])
    assert_bits_equal(dict(model.state_dict()), _dense(cfg, cks[1]))
    assert_bits_equal(_kernels(model), _dense_kernels(cfg, cks[1]))
    status = worker.status()  # reads the kernels back in the calling (engine's) thread
    assert status["known"] and status["held"]["fingerprint"] == held_digests.fingerprint(model)
    assert not held_digests.pending(worker.known.held["digests"])
    r = worker.refit(2)  # its prepare completes the record as well (left pending again by the 1 -> 2 pause)
    assert r.details["mode"] == "delta", r.details
    worker.wait()
    assert_bits_equal(dict(model.state_dict()), _dense(cfg, cks[2]))
    assert_bits_equal(_kernels(model), _dense_kernels(cfg, cks[2]))
    assert worker.refit(2).details["mode"] == "current", "the completed record is what the engine holds"


@pytest.mark.faults(component="engine receiver", outcome="a kernel rebuilt by someone else after the pause, before the next prepare read it back, with its module's tensors untouched: the recorded kernel is gone, the engine is unknown, and the next refit loads it whole, kernels exact")
@pytest.mark.parametrize("when", ["before the digests", "after the digests"])
def test_a_kernel_rebuilt_after_the_pause_leaves_the_engine_unknown(chain, tmp_path, monkeypatch, when):
    cfg, cks, root = chain
    model, worker = _worker(cfg, cks, root, tmp_path, KernelEngine)
    victim = model.get_submodule(linear_layers(model)[0])
    other = _loaded(cfg, cks[2]).get_submodule(linear_layers(model)[0]).weight.detach().clone()
    landed = []

    def rebuild():
        repack(victim, other)  # a new kernel computing with other weights; the module's tensors unchanged
        landed.append(True)

    if when == "before the digests":
        real = engine_apply.settle

        def rebuilt_first(*args):
            if not landed:
                rebuild()
            return real(*args)

        monkeypatch.setattr(engine_apply, "settle", rebuilt_first)
    worker.refit(1)
    worker.wait()
    if when == "after the digests":
        rebuild()
    assert landed
    assert worker.known.held is not None, "the stamps do not see a kernel: only its identity does"
    assert not worker.status()["known"]
    assert worker.refit(1).details["mode"] == "full"
    assert_bits_equal(dict(model.state_dict()), _dense(cfg, cks[1]))
    assert_bits_equal(_kernels(model), _dense_kernels(cfg, cks[1]))

