"""The ``dcr.cond`` delta codec (changes coded against the receiver's old bits) on every path that
reads a step: the CLI, ``dcr verify`` (plain and deep), damaged chunks, mirrors, streaming
followers, live-module receivers. The chain and in-place matrices run it too
(``test_refit.py``'s ``local-cond`` chain, ``test_in_place.py``). Every comparison is on raw bits
against the published checkpoints and a dense materialize.
"""

from __future__ import annotations

import glob
import json
import os
import threading
import uuid

import pytest
import torch
from safetensors.torch import load_file

from dcr_bench.models.llama_vllm import LlamaConfig, VllmLlama, canonical_checkpoint
from dcr_core import events
from dcr_core.errors import IntegrityError
from flows import receive_into_module, run_materialize, run_publish, run_receive
from flows.maintenance import audit
from flows.maintenance.mirror import run_mirror
from flows.options import DELTA_CODECS, PublishOptions, ReceiveOptions
from flows.receive.follow import follow
from flows.streaming import Streaming
from storage import layout
from storage.catalog import Catalog
from storage.held_chunks import PREFETCHED
from storage.root import Root, RootRef
from tests.support.cli import dcr
from tests.support.helpers import (
    assert_bits_equal,
    chain_of_steps,
    chunk_at,
    chunk_named,
    damage_chunk,
    file_bytes,
    module_bits,
    stored_chunks,
    write_safetensors,
)

COND = DELTA_CODECS["cond"]


def _opts(tmp_path, **kw) -> PublishOptions:
    return PublishOptions(**{"chunk_bytes": 512, "cache_dir": str(tmp_path / "cache"), "delta_codec": COND, **kw})


@pytest.fixture
def published(tmp_path):
    root = str(tmp_path / "root")
    cks = chain_of_steps(4, seed=21, big=16, ulps=0.6)
    for i, ck in enumerate(cks):
        run_publish(root, ck, i, options=_opts(tmp_path))
    return root, cks


def test_the_manifest_names_the_codec_and_digests_the_stored_bytes(published):
    root, _ = published
    m = Catalog(Root(root)).manifest(2)
    assert m.codec.name == "dcr.cond"
    report = audit.verify(Root(root), deep=True)
    assert not report.errors, report.errors
    assert report.chunks > 0


def test_a_damaged_chunk_is_named_by_verify_and_refused_by_receivers(published, tmp_path):
    root, cks = published
    state = tmp_path / "rx.safetensors"
    run_receive(root, "rx", str(state), 1)
    before = file_bytes(state)
    largest = max(stored_chunks(root, 2), key=lambda c: chunk_at(root, 2, *c)[2])
    damage_chunk(root, 2, *largest)  # a bit in its middle: inside the Golomb-Rice gaps or the steps, still decodable
    report = audit.verify(Root(root), step=2)
    assert any(chunk_named(root, 2, *largest) in e for e in report.errors), report.errors
    with pytest.raises(IntegrityError, match="digest"):
        run_receive(root, "rx", str(state), 2)
    assert file_bytes(state) == before


def test_the_cli_publishes_with_cond_and_receives_forward_and_back(tmp_path):
    root = str(tmp_path / "root")
    cks = chain_of_steps(3, seed=5, ulps=0.6)
    for i, ck in enumerate(cks):
        path = tmp_path / f"ck{i}.safetensors"
        write_safetensors(path, ck)
        args = ["publish", root, path, "--step", i, "--codec", "cond", "--chunk-bytes", 512]
        dcr(*args, *(["--keyframe"] if i == 0 else []), check=0)
    m = json.loads(open(glob.glob(os.path.join(root, layout.attempts_dir(2), "*", "manifest.json"))[0]).read())
    assert m["codec"] == {"name": "dcr.cond", "clevel": 3}
    state = tmp_path / "rx.safetensors"
    for step, flags in ((2, []), (1, ["--in-place"]), (2, ["--in-place"]), (0, [])):
        dcr("receive", root, "--receiver", "rx", "--state", state, "--step", step, *flags, check=0)
        assert_bits_equal(load_file(state), cks[step])
    dcr("verify", root, "--deep", check=0)


def test_a_mirror_serves_cond_steps_bit_exact(published, tmp_path):
    root, cks = published
    mirror = str(tmp_path / "mirror")
    run_mirror(root, mirror)
    assert not audit.verify(Root(mirror), deep=True).errors
    state = tmp_path / "rx.safetensors"
    for step in (0, 3, 1):
        run_receive(mirror, "rx", str(state), step)
        assert_bits_equal(load_file(state), cks[step])


# Stored objects spread over time, so a follower fetches before the commit: one object per chunk,
# or packed steps in small packs (with 8 MiB packs a test step is one pack, announced last).
SLOW_LAYOUTS = {"per-object": (0, "chunk.stored@*=sleep(0.02)"), "packed": (1024, "pack.stored@*=sleep(0.05)")}


@pytest.mark.parametrize("packing", SLOW_LAYOUTS)
@pytest.mark.parametrize("blocks", [1, 4], ids=["runs", "column-blocks"])
def test_a_streaming_follower_prefetches_cond_chunks_and_decodes_them_after_the_commit(tmp_path, blocks, packing):
    pack_bytes, slow = SLOW_LAYOUTS[packing]
    root = str(tmp_path / "root")
    cks = chain_of_steps(3, seed=44, ulps=0.6, wide=blocks > 1)
    run_publish(root, cks[0], 0, options=_opts(tmp_path, chunk_bytes=256, column_blocks=blocks))
    state = tmp_path / "f.safetensors"
    run_receive(root, "f", str(state), 0)
    hits = PREFETCHED.hits
    streaming = Streaming(RootRef(root, {}))
    polling = threading.Event()
    watch = streaming.watch
    streaming.watch = lambda held: (watch(held), polling.set())
    results, errors = [], []

    def run():
        try:
            for r in follow(RootRef(root, {}), str(state), lambda s: run_receive(root, "f", str(state), s).__dict__,
                            0.02, 2, stream=streaming):
                results.append(r)
        except BaseException as e:  # noqa: BLE001 - asserted below
            errors.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    assert polling.wait(60), "the follower never polled"
    with events.failpoints(slow):
        for step in (1, 2):
            run_publish(root, cks[step], step, options=_opts(tmp_path, chunk_bytes=256, column_blocks=blocks,
                                                             pack_bytes=pack_bytes))
    t.join(120)
    assert not t.is_alive() and not errors, errors
    assert_bits_equal(load_file(state), cks[2])
    assert PREFETCHED.hits > hits  # chunks fetched before the commit were taken by the refit
    assert (len(Catalog(Root(root)).manifest(2).packs()) > 1) == bool(pack_bytes)  # packs landing one after another


@pytest.mark.parametrize("in_place", [False, True], ids=["rewrite", "in-place"])
def test_cond_chunks_in_column_blocks_refit_forward_and_back(tmp_path, in_place):
    """A column block's cond frame decodes against the held bits gathered from its rows."""
    root = str(tmp_path / "root")
    cks = chain_of_steps(4, seed=45, ulps=0.6, wide=True)
    for i, ck in enumerate(cks):
        run_publish(root, ck, i, options=_opts(tmp_path, chunk_bytes=256, column_blocks=4))
    assert any(e.grid.is_blocked and e.n_stored for e in Catalog(Root(root)).manifest(2).tensors.values())
    state = tmp_path / "rx.safetensors"
    for step in [0, 3, 1, 2, 0, 3]:
        run_receive(root, "rx", str(state), step, options=ReceiveOptions(in_place=in_place))
        assert_bits_equal(load_file(state), cks[step])


def test_live_module_receivers_load_cond_steps_whole_and_exactly(tmp_path):
    """A live module holds its weights in its own layout, so ``dcr.cond`` steps are loaded through
    the loader from a verified full checkpoint (mode "dense"); the result is the dense load's."""
    cfg = LlamaConfig()
    root = f"memory://cond-{uuid.uuid4().hex}"
    first = canonical_checkpoint(cfg, seed=3)
    cks = [first]
    g = torch.Generator().manual_seed(1)
    for _ in range(2):
        nxt = {n: t.clone() for n, t in cks[-1].items()}
        for t in nxt.values():
            if t.dtype == torch.bfloat16:
                bits = t.view(-1).view(torch.int16)
                hit = torch.rand(bits.numel(), generator=g) < 0.03
                bits[hit] += 1
        cks.append(nxt)
    for s, ck in enumerate(cks):
        run_publish(root, ck, s, options=_opts(tmp_path, chunk_bytes=2048))
    mod = VllmLlama(cfg)
    for step in (0, 2, 1):
        res = receive_into_module(root, "m", mod, step, state_path=str(tmp_path / "m.safetensors"))
        assert res["mode"] == "dense"
        ref = VllmLlama(cfg)
        ref.load_weights(list(cks[step].items()))
        assert_bits_equal(module_bits(mod), module_bits(ref))
    run_materialize(root, 2, str(tmp_path / "full.safetensors"))
    assert_bits_equal(load_file(tmp_path / "full.safetensors"), cks[2])
