"""``dcr mirror``: committed steps copied to another ROOT (and on to a third), byte for byte, marker
last; receivers refit from a mirror as from the origin, checked against the origin's signature."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import uuid

import pytest
from safetensors.torch import load_file

from dcr_core import events
from dcr_core.errors import IntegrityError, StepConflictError, UntrustedError
from flows import run_publish, run_receive
from flows.maintenance.mirror import run_mirror
from flows.options import PublishOptions
from storage import layout
from tests.support.cli import dcr
from tests.support.helpers import (
    assert_bits_equal,
    chunk_at,
    chunk_named,
    damage_chunk,
    file_bytes,
    nasty_checkpoint,
    next_step,
    stored_chunks,
    tree_snapshot,
)
from tests.support.kill import kill_at, sweep
from tests.support.publishing import publish_steps


def _chain(n: int) -> list[dict]:
    cks = [nasty_checkpoint(seed=3)]
    for s in range(1, n):
        cks.append(next_step(cks[-1], seed=s))
    return cks


def _attempt_files(root: str, step: int) -> dict[str, bytes]:
    marker = json.load(open(os.path.join(root, layout.commit_key(step))))
    return tree_snapshot(os.path.join(root, layout.attempt_dir(step, marker["attempt"])))


@pytest.fixture
def origin(tmp_path):
    root = str(tmp_path / "origin")
    cks = _chain(3)
    publish_steps(root, cks, cache_dir=tmp_path / "pub", chunk_bytes=4096)
    return root, cks


def test_a_mirror_of_a_mirror_serves_the_origins_steps_bit_exact(origin, tmp_path):
    root, cks = origin
    # an attempt that never committed (a publisher that died) and a losing one: never mirrored
    steps = os.path.join(root, "steps")
    dead = os.path.join(steps, f"{3:012d}", "attempts", "ab" * 8)
    shutil.copytree(os.path.join(root, os.path.dirname(layout.manifest_key(2, json.load(open(os.path.join(
        root, layout.commit_key(2))))["attempt"]))), dead)
    a, b = str(tmp_path / "region-a"), str(tmp_path / "region-b")
    r1 = run_mirror(root, a)
    assert r1.copied_steps == [0, 1, 2] and r1.bytes_copied > 0
    r2 = run_mirror(a, b)
    assert r2.copied_steps == [0, 1, 2]
    for s in range(3):
        assert _attempt_files(b, s) == _attempt_files(root, s)  # byte for byte, the committed attempt only
        assert file_bytes(os.path.join(b, layout.commit_key(s))) == file_bytes(os.path.join(root, layout.commit_key(s)))
    assert not os.path.exists(os.path.join(b, "steps", f"{3:012d}"))
    assert file_bytes(os.path.join(b, layout.RUN)) == file_bytes(os.path.join(root, layout.RUN))
    state = tmp_path / "s.safetensors"
    for s in (0, 2, 1):  # forward and back, from the second-level mirror
        run_receive(b, "rollout", str(state), s)
        assert_bits_equal(load_file(state), cks[s])
    again = run_mirror(a, b)  # idempotent: nothing copied, every step checked
    assert again.copied_steps == [] and again.present_steps == [0, 1, 2] and again.objects_copied == 0


def test_a_new_upstream_step_is_mirrored_alone(origin, tmp_path):
    root, cks = origin
    a = str(tmp_path / "a")
    run_mirror(root, a)
    cks.append(next_step(cks[-1], seed=9))
    run_publish(root, cks[3], 3, options=PublishOptions(chunk_bytes=4096, cache_dir=str(tmp_path / "pub")))
    r = run_mirror(root, a, step=3)
    assert r.copied_steps == [3]
    state = tmp_path / "s.safetensors"
    run_receive(a, "r", str(state))
    assert_bits_equal(load_file(state), cks[3])


@pytest.mark.faults(component="mirror", outcome="nothing visible downstream; a rerun commits bit-exact")
@pytest.mark.parametrize("point", sweep(["mirror.object-copied@3", "mirror.payload-copied@2"], {"mirror.payload-copied@2"}))
def test_a_mirror_killed_mid_copy_shows_nothing_and_a_rerun_completes(origin, tmp_path, point):
    root, cks = origin
    a = str(tmp_path / "a")
    err = kill_at(point, "mirror", root, a)
    assert f"failpoint {point} reached" in err
    cut = int(point.split("@")[1]) - 1 if point.startswith("mirror.payload") else 0  # the step cut off
    assert not os.path.exists(os.path.join(a, layout.commit_key(cut)))  # its marker was never written
    out = dcr("ls", a, "--json", check=0)
    assert [r["step"] for r in json.loads(out.stdout) if r["committed"]] == list(range(cut))
    dcr("mirror", root, a, check=0)
    state = tmp_path / "s.safetensors"
    run_receive(a, "r", str(state))
    assert_bits_equal(load_file(state), cks[2])


@pytest.mark.faults(component="mirror", outcome="refused with a one-line error; the downstream ROOT unchanged")
def test_a_downstream_root_of_another_run_or_another_attempt_is_refused(origin, tmp_path):
    root, cks = origin
    other = str(tmp_path / "other")
    publish_steps(other, cks[:1], cache_dir=tmp_path / "pub", chunk_bytes=4096)  # another run (its own run.json), step 0 of another attempt
    before = tree_snapshot(other)
    with pytest.raises(StepConflictError) as ei:
        run_mirror(root, other)
    assert len(str(ei.value).splitlines()) == 1
    assert tree_snapshot(other) == before


@pytest.fixture
def signed_origin(tmp_path, monkeypatch):
    """An origin published with an Ed25519 private key; from then on this process (and the dcr
    commands it starts) holds only the public key, as mirrors and receivers do."""
    from storage import signing

    signing.keygen(tmp_path / "key")
    monkeypatch.setenv("DCR_SIGNING_KEY_FILE", str(tmp_path / "key"))
    root = str(tmp_path / "origin")
    cks = _chain(2)
    publish_steps(root, cks, cache_dir=tmp_path / "pub", chunk_bytes=4096)
    monkeypatch.delenv("DCR_SIGNING_KEY_FILE")
    monkeypatch.setenv("DCR_VERIFY_KEY_FILE", str(tmp_path / "key.pub"))
    return root, cks


@pytest.mark.faults(component="mirror", outcome="refused: a mirror only forwards what the origin's key signed")
def test_ed25519_the_mirror_and_its_receivers_hold_only_the_public_key(signed_origin, tmp_path):
    root, cks = signed_origin
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    run_mirror(root, a)
    state = tmp_path / "s.safetensors"
    run_receive(a, "r", str(state))
    assert_bits_equal(load_file(state), cks[1])
    # a mirror that alters a marker: the next mirror and every receiver refuse it
    path = os.path.join(a, layout.commit_key(1))
    d = json.load(open(path))
    d["summary"]["bytes_stored"] = 1
    json.dump(d, open(path, "w"))
    with pytest.raises(IntegrityError, match="signature"):
        run_mirror(a, b)
    assert not os.path.exists(os.path.join(b, layout.commit_key(1)))
    with pytest.raises(IntegrityError, match="signature"):
        run_receive(a, "r2", str(tmp_path / "s2.safetensors"))


def test_a_failed_copy_in_process_leaves_no_marker_downstream(origin, tmp_path):
    root, _ = origin
    a = str(tmp_path / "a")
    events.set_failpoints("mirror.object-copied@2=raise")
    try:
        with pytest.raises(events.FailpointError):
            run_mirror(root, a)
    finally:
        events.set_failpoints("")
    assert not os.path.exists(os.path.join(a, layout.commit_key(0)))


@pytest.mark.backend
def test_mirror_between_two_s3_servers_with_their_own_options(s3_server, tmp_path):
    """SRC on the session's S3 server, DST on a second server with its own endpoint and credentials."""
    import boto3
    from moto.server import ThreadedMotoServer

    from tests.support.servers import S3_BUCKET

    second = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    second.start()
    try:
        host, port = second.get_host_and_port()
        url2 = f"http://{host}:{port}"
        boto3.client("s3", endpoint_url=url2, aws_access_key_id="region-b", aws_secret_access_key="b-secret",
                     region_name="us-east-1").create_bucket(Bucket="region-b")
        src = f"s3://{S3_BUCKET}/origin-{uuid.uuid4().hex[:8]}"
        cks = _chain(2)
        for s, ck in enumerate(cks):
            run_publish(src, ck, s, options=PublishOptions(chunk_bytes=4096, cache_dir=str(tmp_path / "pub")))
        dst_opts = [f"endpoint_url={url2}", "key=region-b", "secret=b-secret"]
        dcr("mirror", src, "s3://region-b/mirror", *[x for o in dst_opts for x in ("--dst-storage-option", o)], check=0)
        state = tmp_path / "s.safetensors"
        dcr("receive", "s3://region-b/mirror", "--receiver", "r", "--state", state,
            *[x for o in dst_opts for x in ("--storage-option", o)], check=0)
        assert_bits_equal(load_file(state), cks[1])
    finally:
        second.stop()


def test_follow_with_a_step_is_refused():
    out = dcr("mirror", "a", "b", "--step", "1", "--follow", check=2)
    assert "--follow" in out.stderr


# -- receivers with fallback ROOTs: the nearest first --------------------------------------------


def test_a_receiver_falls_back_upstream_when_its_mirror_lags_or_misses_an_object(origin, tmp_path):
    from flows.receive.nearest import receive_nearest
    from storage.catalog import Catalog
    from storage.root import open_root

    root, cks = origin
    a = str(tmp_path / "a")
    run_mirror(root, a, step=0)
    run_mirror(root, a, step=1)  # the mirror lags: step 2 is upstream only
    state = str(tmp_path / "s.safetensors")
    warned: list[str] = []
    r = receive_nearest([a, root], "r", state, warn=warned.append)
    assert r.step == 2 and warned == []
    assert_bits_equal(load_file(state), cks[2])
    assert Catalog(open_root(root)).position("r")["step"] == 2  # recorded where it was served
    run_mirror(root, a, step=2)  # caught up (until then it could not vouch for the state's step 2 either)
    r = receive_nearest([a, root], "r", state, step=1, warn=warned.append)  # the mirror has it: served there
    assert r.step == 1 and Catalog(open_root(a)).position("r")["step"] == 1 and warned == []
    os.unlink(chunk_at(a, 2, *stored_chunks(a, 2)[0])[0])  # the mirror lost an object (a pack, or a chunk's own)
    r = receive_nearest([a, root], "r", state, warn=warned.append)
    assert r.step == 2 and len(warned) == 1 and a in warned[0] and "trying the next ROOT" in warned[0]
    assert_bits_equal(load_file(state), cks[2])


@pytest.mark.faults(component="mirror", outcome="the receiver refuses the mirror and falls back upstream; alone, it fails")
def test_the_cli_falls_back_from_a_mirror_whose_marker_does_not_verify(signed_origin, tmp_path):
    root, cks = signed_origin
    env = {"DCR_VERIFY_KEY_FILE": os.environ["DCR_VERIFY_KEY_FILE"]}  # the commands hold the public key only
    a = str(tmp_path / "a")
    dcr("mirror", root, a, env=env, check=0)
    path = os.path.join(a, layout.commit_key(1))
    d = json.load(open(path))
    d["policy_digest"] = "0" * 64  # a mirror that alters what it forwards
    json.dump(d, open(path, "w"))
    state = tmp_path / "s.safetensors"
    out = dcr("receive", a, "--receiver", "r", "--state", state, env=env, check=5)
    assert "signature" in out.stderr and len(out.stderr.strip().splitlines()) == 1 and not state.exists()
    out = dcr("receive", a, "--fallback-root", root, "--receiver", "r", "--state", state, env=env, check=0)
    assert "trying the next ROOT" in out.stderr
    assert_bits_equal(load_file(state), cks[1])


def test_a_mirror_registered_upstream_keeps_what_it_needs_from_upstream_gc(origin, tmp_path):
    from flows.maintenance.gc import run_gc
    from flows.options import GcOptions
    from storage.catalog import Catalog
    from storage.root import open_root

    root, cks = origin
    opts = PublishOptions(chunk_bytes=4096, cache_dir=str(tmp_path / "pub"))
    for s in (3, 4):  # step 3 a keyframe: without receivers, gc keeping 1 step needs only 3 and 4
        cks.append(next_step(cks[-1], seed=s))
        run_publish(root, cks[s], s, keyframe=s == 3, options=opts)
    assert 0 in run_gc(root, GcOptions(keep_last=1, dry_run=True)).plan.delete_steps  # nobody needs step 0 yet
    a = str(tmp_path / "a")
    run_mirror(root, a, step=0, as_id="mirror-eu")  # the mirror is at step 0
    assert Catalog(open_root(root)).position("mirror-eu")["step"] == 0
    kept = run_gc(root, GcOptions(keep_last=1, grace_seconds=0))
    assert 0 not in kept.deleted_steps and 0 in Catalog(open_root(root)).committed_steps()
    run_mirror(root, a, as_id="mirror-eu")  # the mirror catches up: step 0 is needed no more
    assert Catalog(open_root(root)).position("mirror-eu")["step"] == 4
    assert 0 in run_gc(root, GcOptions(keep_last=1, grace_seconds=0)).deleted_steps
    state = tmp_path / "s.safetensors"
    run_receive(a, "r", str(state))
    assert_bits_equal(load_file(state), cks[4])


@pytest.mark.faults("mirror", component="mirror", outcome="refused naming the object; nothing of the step committed downstream")
@pytest.mark.parametrize("damage", ["chunk", "chunk-object", "manifest"])
def test_a_mirror_refuses_to_copy_a_damaged_step_onward(origin, tmp_path, damage):
    """A chunk (in its pack, or its own object: ``--pack-bytes 0``) or the manifest of step 2
    damaged upstream after its commit: ``dcr mirror`` exits 5 naming that object (a packed chunk by
    its pack and range), commits steps 0 and 1 downstream and nothing of step 2; the copy verifies.
    Repaired upstream, a rerun mirrors step 2 exactly."""
    root, cks = origin
    if damage == "chunk-object":
        root = str(tmp_path / "unpacked")
        for s, ck in enumerate(cks):
            run_publish(root, ck, s, options=PublishOptions(chunk_bytes=4096, cache_dir=str(tmp_path / "pub0"), pack_bytes=0))
    if damage == "manifest":
        files = _attempt_files(root, 2)
        marker = json.load(open(os.path.join(root, layout.commit_key(2))))
        path = os.path.join(root, layout.attempt_dir(2, marker["attempt"]), next(k for k in files if k.endswith("manifest.json")))
        named = os.path.relpath(path, root)
    else:
        largest = max(stored_chunks(root, 2), key=lambda c: chunk_at(root, 2, *c)[2])
        path, named = chunk_at(root, 2, *largest)[0], chunk_named(root, 2, *largest)
        assert (f"/{layout.PACKS}/" in named) == (damage == "chunk")
    good = file_bytes(path)
    if damage == "manifest":
        bad = bytearray(good)
        bad[len(bad) // 2] ^= 0x01
        with open(path, "wb") as f:
            f.write(bytes(bad))
    else:
        damage_chunk(root, 2, *largest)
    region = str(tmp_path / "region")
    out = dcr("mirror", root, region)
    assert out.returncode == 5 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert named in out.stderr, (named, out.stderr)
    from storage.catalog import Catalog
    from storage.root import Root

    assert Catalog(Root(region)).committed_steps() == [0, 1]
    dcr("verify", region, check=0)
    with open(path, "wb") as f:
        f.write(good)
    dcr("mirror", root, region, check=0)
    state = tmp_path / "s.safetensors"
    run_receive(region, "r", str(state))
    assert_bits_equal(load_file(state), cks[-1])


LAYOUTS = {"per-object": 0, "packed": 8 << 20}  # publish --pack-bytes: one object per chunk, or packs


def _origin_in(tmp_path, pack_bytes: int) -> tuple[str, list[dict]]:
    """The ``origin`` fixture's chain, laid out as ``pack_bytes`` says."""
    root = str(tmp_path / "origin")
    cks = _chain(3)
    for s, ck in enumerate(cks):
        run_publish(root, ck, s, options=PublishOptions(chunk_bytes=4096, cache_dir=str(tmp_path / "pub"),
                                                        pack_bytes=pack_bytes))
    return root, cks


@pytest.mark.faults("mirror", component="mirror", outcome="copied again from upstream, checked; the step downstream "
                    "is the origin's, byte for byte")
@pytest.mark.parametrize("packing", LAYOUTS)
@pytest.mark.parametrize("vouched", ["no-index", "forged-index"])
def test_a_chunk_already_downstream_that_the_manifest_does_not_vouch_for_is_copied_again(tmp_path, vouched, packing):
    """Before the commit, a chunk of step 2 (a packed step: a pack) lies downstream at its key and
    size but with other bytes (a streaming mirror forwarded what a forged stream index described, or
    a copy was cut off and damaged). The mirror reads it back, finds it does not match the manifest,
    copies it again from upstream, and commits: the attempt downstream equals the origin's, and a
    receiver is exact. A forged index vouches for nothing: not a chunk under a digest the manifest
    does not give, nor a pack under its chunks' very digests (no index vouches for a whole pack)."""
    from dcr_core.chunking import ChunkGrid
    from flows.options import KEYFRAMES
    from storage.catalog import Catalog
    from storage.root import Root
    from storage.stream import StreamedChunk, StreamIndex

    root, cks = _origin_in(tmp_path, LAYOUTS[packing])
    region = str(tmp_path / "region")
    files = _attempt_files(root, 2)
    stored = [k for k in files if f"/{layout.PACKS}/" in k] if LAYOUTS[packing] else [k for k in files if "/c/" in k]
    key = max(stored, key=lambda k: len(files[k]))
    marker = json.load(open(os.path.join(root, layout.commit_key(2))))
    attempt = marker["attempt"]
    down = os.path.join(region, layout.attempt_dir(2, attempt), key)
    os.makedirs(os.path.dirname(down), exist_ok=True)
    with open(down, "wb") as f:
        f.write(bytes(len(files[key])))
    if vouched == "forged-index":  # an index downstream naming that object
        if not LAYOUTS[packing]:  # with a digest the manifest does not give
            in_store = os.path.relpath(os.path.join(region, layout.attempt_dir(2, attempt), key),
                                       os.path.join(region, layout.store_dir(2, attempt)))
            codec, chunks = KEYFRAMES, (StreamedChunk("x", "F32", ChunkGrid((4,), (4,)), in_store, 0, "0" * 64,
                                                      len(files[key])),)
        else:  # every chunk of the pack, as the publisher's own index names it (digest, size, place)
            pack, m = key.rsplit("/", 1)[1], Catalog(Root(root)).manifest(2)
            codec, chunks = m.codec, tuple(
                StreamedChunk(e.name, e.dtype, e.grid, layout.chunk_key(e.array, e.grid.grid_index(c.indices[p])),
                              c.indices[p], c.digests[p], c.nbytes[p], pack, c.offsets[p])
                for e in m.tensors.values() for c in [e.chunks] for p in range(len(c)) if c.packs[p] == pack)
            assert chunks
        Root(region).write(layout.stream_key(2, attempt, 0), StreamIndex(2, attempt, 0, codec, chunks, True).to_json())
    run_mirror(root, region)
    assert _attempt_files(region, 2)[key] == files[key]
    state = tmp_path / "s.safetensors"
    run_receive(region, "r", str(state))
    assert_bits_equal(load_file(state), cks[2])


# -- what a mirror writes is what it verified; what does not verify downstream is replaced -------


def _edit_json(path: str, edit) -> None:
    d = json.load(open(path))
    edit(d)
    with open(path, "w") as f:
        json.dump(d, f)


@contextlib.contextmanager
def _edited_after_first_read(url: str, key: str, edited: bytes):
    """An upstream writer who edits ``key`` of ``url`` right after its first read in the block, and
    restores it at the block's end: every later read in it returns ``edited``. The race of a writer
    between a reader's check and its copy, made exact."""
    from storage.root import Root

    real = Root.read
    seen = []

    def read(self, k, limit=None):
        if self.url == url and k == key:
            seen.append(k)
            if len(seen) > 1:
                return edited
        return real(self, k, limit)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Root, "read", read)
        yield


@pytest.mark.faults(component="mirror", outcome="the marker it verified is committed downstream, not the edit; "
                    "receivers of the mirror are exact")
def test_a_marker_edited_upstream_while_its_step_is_copied_reaches_downstream_as_verified(signed_origin, tmp_path):
    """A writer edits a signed field of step 1's marker upstream while the mirror copies the step:
    the mirror commits the bytes it verified, so its receivers accept the step; upstream restored,
    the next run finds the step in place."""
    root, cks = signed_origin
    a = str(tmp_path / "a")
    path = os.path.join(root, layout.commit_key(1))
    good = file_bytes(path)

    def edit(point, fields):
        if point == "mirror.payload-copied" and fields["step"] == 1:
            _edit_json(path, lambda d: d["summary"].update(chain_bytes=1))

    with events.listening(edit):
        r = run_mirror(root, a)
    assert r.copied_steps == [0, 1]
    assert file_bytes(os.path.join(a, layout.commit_key(1))) == good
    state = tmp_path / "s.safetensors"
    run_receive(a, "r", str(state))
    assert_bits_equal(load_file(state), cks[1])
    with open(path, "wb") as f:
        f.write(good)
    assert run_mirror(root, a).present_steps == [0, 1]


@pytest.mark.faults(component="mirror", outcome="replaced by upstream's verified marker on the next run; receivers exact")
@pytest.mark.parametrize("damage", ["signed-field", "not-json"])
def test_a_marker_that_does_not_verify_downstream_is_replaced_on_the_next_run(signed_origin, tmp_path, damage):
    """A mirror wedged earlier (a marker copied while upstream's was edited) or a downstream writer
    leaves step 1's marker there not verifying: receivers refuse it, and the next ``dcr mirror``
    replaces it with upstream's (checked objects first), after which they receive exactly."""
    root, cks = signed_origin
    a = str(tmp_path / "a")
    run_mirror(root, a)
    path = os.path.join(a, layout.commit_key(1))
    if damage == "signed-field":
        _edit_json(path, lambda d: d["summary"].update(chain_bytes=1))
    else:
        with open(path, "wb") as f:
            f.write(b"{")
    state = tmp_path / "s.safetensors"
    with pytest.raises(IntegrityError):
        run_receive(a, "r", str(state))
    r = run_mirror(root, a)
    assert r.copied_steps == [1]
    assert file_bytes(path) == file_bytes(os.path.join(root, layout.commit_key(1)))
    run_receive(a, "r", str(state))
    assert_bits_equal(load_file(state), cks[1])


@pytest.fixture
def retracted_origin(signed_origin, tmp_path, monkeypatch):
    """``signed_origin`` mirrored to ``a``, then step 1 retracted at the origin (signed)."""
    from flows import run_retract

    root, cks = signed_origin
    a = str(tmp_path / "a")
    run_mirror(root, a)
    monkeypatch.setenv("DCR_SIGNING_KEY_FILE", str(tmp_path / "key"))
    run_retract(root, 1, "bad step")
    monkeypatch.delenv("DCR_SIGNING_KEY_FILE")
    return root, a, cks


@pytest.mark.faults(component="mirror", outcome="the retraction record it verified is copied, not the edit")
def test_a_retraction_edited_upstream_while_it_is_copied_reaches_downstream_as_verified(retracted_origin):
    """Upstream's retraction record of step 1 is edited right after the mirror checked it: the
    mirror copies the bytes it checked (or refuses), and once upstream is restored the mirror and
    its receivers hold the origin's record."""
    from storage.catalog import Catalog
    from storage.root import open_root

    root, a, _ = retracted_origin
    key = layout.retraction_key(1)
    good = file_bytes(os.path.join(root, key))
    forged = json.loads(good)
    forged["reason"] = "edited"
    with _edited_after_first_read(open_root(root).url, key, json.dumps(forged).encode()):
        with contextlib.suppress(UntrustedError):  # a later look upstream may see the edit: refused, nothing copied
            run_mirror(root, a)
    run_mirror(root, a)  # upstream restored
    assert file_bytes(os.path.join(a, key)) == good
    assert Catalog(open_root(a)).retraction(1).reason == "bad step"


@pytest.mark.faults(component="mirror", outcome="a retraction record that does not verify downstream is removed, or "
                    "replaced by upstream's; receivers of the mirror go on")
@pytest.mark.parametrize("upstream", ["live", "retracted"])
def test_a_retraction_that_does_not_verify_downstream_is_replaced(signed_origin, tmp_path, monkeypatch, upstream):
    """An unsigned retraction record of step 1 planted in the mirror (its receivers refuse it):
    the next ``dcr mirror`` removes it where upstream has none, and replaces it with upstream's
    where step 1 is retracted there; receivers of the mirror then go on exactly."""
    from flows import run_retract
    from storage.catalog import Catalog
    from storage.root import open_root

    root, cks = signed_origin
    a = str(tmp_path / "a")
    run_mirror(root, a)
    if upstream == "retracted":
        monkeypatch.setenv("DCR_SIGNING_KEY_FILE", str(tmp_path / "key"))
        run_retract(root, 1, "bad step")
        monkeypatch.delenv("DCR_SIGNING_KEY_FILE")
    marker = json.load(open(os.path.join(a, layout.commit_key(1))))
    planted = {"format": "dcr-retraction", "step": 1, "attempt": marker["attempt"],
               "manifest_digest": marker["manifest_digest"], "retracted_at": "2030-01-01T00:00:00Z",
               "reason": "planted", "run": marker["run"]}  # unsigned
    with open(os.path.join(a, layout.retraction_key(1)), "w") as f:
        json.dump(planted, f)
    run_mirror(root, a)
    if upstream == "live":
        assert not os.path.exists(os.path.join(a, layout.retraction_key(1)))
    else:
        assert file_bytes(os.path.join(a, layout.retraction_key(1))) == file_bytes(os.path.join(root, layout.retraction_key(1)))
    state = tmp_path / "s.safetensors"
    run_receive(a, "r", str(state))
    assert_bits_equal(load_file(state), cks[1 if upstream == "live" else 0])
    assert Catalog(open_root(a)).latest_committed() == (1 if upstream == "live" else 0)


@pytest.mark.faults(component="mirror", outcome="the heartbeat it verified is copied, not the edit; --max-staleness "
                    "receivers of the mirror go on")
def test_a_heartbeat_edited_upstream_while_it_is_copied_reaches_downstream_as_verified(signed_origin, tmp_path):
    """Upstream's heartbeat is replaced by an unsigned one dated a year ahead right after the mirror
    checked it: the mirror copies the bytes it checked (or refuses), and once upstream is restored
    the mirror's heartbeat is the origin's, which its ``--max-staleness`` receivers accept."""
    import time

    from storage import heartbeat
    from storage.catalog import Catalog
    from storage.root import open_root

    root, _ = signed_origin
    a = str(tmp_path / "a")
    good = file_bytes(os.path.join(root, heartbeat.KEY))
    forged = json.loads(good)
    forged.pop("signature")
    forged["at"] = time.time() + 365 * 86400
    with _edited_after_first_read(open_root(root).url, heartbeat.KEY, json.dumps(forged).encode()):
        with contextlib.suppress(UntrustedError):
            run_mirror(root, a)
    run_mirror(root, a)  # upstream restored
    assert file_bytes(os.path.join(a, heartbeat.KEY)) == good
    heartbeat.check_fresh(open_root(a), 600, Catalog(open_root(a)).key)


# -- stream indexes downstream: read within what the manifest's chunks can take ------------------


@pytest.mark.faults(component="mirror", outcome="forged stream indexes downstream are read up to a bound set by the "
                    "manifest (one warning), then ignored; the step is committed exactly")
@pytest.mark.parametrize("packing", LAYOUTS)
def test_forged_stream_indexes_downstream_cost_at_most_the_index_budget(tmp_path, monkeypatch, caplog, packing):
    """Four stream indexes of about 1 MiB each, forged downstream for step 2's attempt (a streaming
    mirror's followers would read them): the mirror reads at most ``index_budget`` bytes of them,
    says so in one warning, reads back and checks the chunks instead, and commits the step exactly.
    A packed step's objects downstream are packs, which no index vouches for: it reads no index."""
    from dcr_core.chunking import ChunkGrid
    from flows.maintenance.mirror import index_budget
    from flows.options import KEYFRAMES
    from storage.catalog import Catalog
    from storage.root import Root, open_root
    from storage.stream import StreamedChunk, StreamIndex

    root, cks = _origin_in(tmp_path, LAYOUTS[packing])
    region = str(tmp_path / "region")
    for step in (0, 1):
        run_mirror(root, region, step=step)
    attempt = json.load(open(os.path.join(root, layout.commit_key(2))))["attempt"]
    files = _attempt_files(root, 2)
    for key in files:  # a streaming mirror forwarded every object of step 2, then stopped before the commit
        down = os.path.join(region, layout.attempt_dir(2, attempt), key)
        os.makedirs(os.path.dirname(down), exist_ok=True)
        with open(down, "wb") as f:
            f.write(files[key])
    n = 16_000
    grid = ChunkGrid((n,), (1,))
    for seq in range(4):
        chunks = tuple(StreamedChunk("w", "U8", grid, f"forged/c/{i}", i, f"{i:064x}", 1) for i in range(n))
        data = StreamIndex(2, attempt, seq, KEYFRAMES, chunks, seq == 3).to_json()
        assert len(data) > 1 << 20
        Root(region).write(layout.stream_key(2, attempt, seq), data)
    read_bytes, read_downstream = [], []
    real = Root.read

    def counting(self, key, limit=None):
        data = real(self, key, limit)
        if "/stream/" in key:
            read_bytes.append(len(data))
            if self.url == Root(region).url:
                read_downstream.append(key)
        return data

    monkeypatch.setattr(Root, "read", counting)
    budget = index_budget(Catalog(open_root(root)).manifest(2))
    with caplog.at_level("WARNING", logger="dcr.mirror"):
        r = run_mirror(root, region)
    assert r.copied_steps == [2] and sum(read_bytes) <= budget + 1 < 1 << 20
    warned = [rec.getMessage() for rec in caplog.records if rec.name == "dcr.mirror"]
    if LAYOUTS[packing]:  # upstream's own index is copied; none downstream is read
        assert not read_downstream and not warned
    else:
        assert len(warned) == 1 and layout.stream_key(2, attempt, 0) in warned[0] and "\n" not in warned[0]
    state = tmp_path / "s.safetensors"
    run_receive(region, "r", str(state))
    assert_bits_equal(load_file(state), cks[2])
