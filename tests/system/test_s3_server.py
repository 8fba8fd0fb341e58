"""S3-specific behaviour against the moto server: racing processes, what a receiver pulls, retries."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid

import pytest
import torch
from safetensors.torch import load_file

from dcr_bench.netproxy import Proxy
from flows import run_publish, run_receive
from flows.options import PublishOptions, ReceiveOptions
from storage import layout
from storage.catalog import Catalog
from storage.chunk_io import MAX_GAP_BYTES
from storage.root import Root
from tests.support.helpers import assert_bits_equal, write_safetensors
from tests.support.procs import Lines, reported
from tests.support.servers import S3_BUCKET

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository


def _model(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        f"layers.{i}.{n}": torch.randn(512, 256, generator=g).bfloat16()
        for i in range(4)
        for n in ("attn.weight", "mlp.weight")
    } | {"norm.weight": torch.ones(256).bfloat16(), "inv_freq": torch.arange(64, dtype=torch.float32)}


def _step(ck, frac: float, seed: int, only: str | None = None) -> dict[str, torch.Tensor]:
    """Flip the lowest mantissa bit of ``frac`` of the elements (of tensor ``only``, if given)."""
    g = torch.Generator().manual_seed(seed)
    out = {n: t.clone() for n, t in ck.items()}
    for n, t in out.items():
        if (only and n != only) or t.dtype != torch.bfloat16:
            continue
        bits = t.view(-1).view(torch.int16)
        mask = torch.rand(bits.numel(), generator=g) < frac
        bits[mask] ^= 1
    return out


@pytest.mark.faults(component="publisher", outcome="exactly one commit; the others exit 3 with one line")
@pytest.mark.slow
def test_sixteen_publisher_processes_racing_for_one_step_commit_exactly_once(s3_server, tmp_path):
    root = f"s3://{S3_BUCKET}/race-{uuid.uuid4().hex[:8]}"
    base = _model(0)
    p0 = tmp_path / "c0.safetensors"
    write_safetensors(p0, base)
    env = {**os.environ, "DCR_ORCHESTRATOR": "none", "DCR_CACHE_DIR": str(tmp_path / "cache")}
    subprocess.run([sys.executable, "-m", "flows.cli", "publish", root, str(p0), "--step", "0"], env=env, check=True, cwd=REPO)
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    n = 16
    cands = []
    for i in range(n):
        p = tmp_path / f"cand{i}.safetensors"
        write_safetensors(p, _step(base, 0.01, seed=i + 1, only="layers.0.attn.weight"))
        cands.append(p)
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.support.race_publisher", str(barrier), str(n), "--",
             "publish", root, str(p), "--step", "1", "--io-workers", "2"],
            env={**env, "DCR_CACHE_DIR": str(tmp_path / f"cache{i}")}, cwd=REPO,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for i, p in enumerate(cands)
    ]
    results = [(p.wait(timeout=300), p.stderr.read()) for p in procs]
    assert len(os.listdir(barrier)) == n, ("every publisher reached the commit", results[:2])
    winners = [i for i, (rc, _) in enumerate(results) if rc == 0]
    assert len(winners) == 1, results
    for i, (rc, err) in enumerate(results):
        if i != winners[0]:
            assert rc == 3, err
            assert "committed by another publisher" in err and len(err.strip().splitlines()) == 1
    # the manifest references only the winner's attempt, and the losers' attempts are gone
    r = Root(root)
    marker = Catalog(r).marker(1)
    m = Catalog(r).manifest(1)
    assert m.attempt == marker.attempt
    assert r.listdir(f"{layout.step_dir(1)}/attempts") == [marker.attempt]
    state = tmp_path / "s.safetensors"
    run_receive(root, "rx", str(state))
    assert_bits_equal(load_file(state), load_file(cands[winners[0]]))


@pytest.fixture
def proxied_s3(s3_server, monkeypatch):
    """The S3 server behind a counting, fault-injecting proxy; AWS_ENDPOINT_URL points at the proxy."""
    with Proxy(s3_server) as proxy:
        # passed explicitly: fsspec caches filesystem instances, so an environment change alone
        # would not reach an S3 client created earlier in the session
        proxy.storage_options = {"endpoint_url": proxy.url}
        yield proxy


def test_a_receiver_pulls_only_the_changed_chunks_plus_metadata(proxied_s3, tmp_path):
    proxy = proxied_s3
    root = f"s3://{S3_BUCKET}/pull-{uuid.uuid4().hex[:8]}"
    opts = PublishOptions(chunk_bytes=64 << 10, cache_dir=str(tmp_path / "cache"))
    base = _model(1)
    so = proxy.storage_options
    run_publish(root, base, 0, storage_options=so, options=opts)
    state = tmp_path / "s.safetensors"
    run_receive(root, "rx", str(state), storage_options=so)
    new = _step(base, 0.03, seed=7, only="layers.2.mlp.weight")  # 3% of one tensor changes
    run_publish(root, new, 1, storage_options=so, options=opts)
    m = Catalog(Root(root, so)).manifest(1)
    changed = [e for e in m.tensors.values() if len(e.chunks)]
    assert [e.name for e in changed] == ["layers.2.mlp.weight"]
    chunk_bytes = sum(e.stored_bytes for e in changed)
    n_chunks = sum(len(e.chunks) for e in changed)
    full = sum(e.nbytes for e in m.tensors.values())

    proxy.reset_counts()
    res = run_receive(root, "rx", str(state), storage_options=so, options=ReceiveOptions(io_workers=4))
    assert_bits_equal(load_file(state), new)
    gets = [(path, size) for method, path, status, size in proxy.log if method == "GET" and "list-type" not in path and "?" not in path]
    chunk_gets = [g for g in gets if "/data.zarr/" in g[0]]  # ranges of packs (or chunk objects, --pack-bytes 0)
    metadata = sum(size for path, size in gets if "/data.zarr/" not in path)
    data = sum(size for _, size in chunk_gets)
    assert res.bytes_pulled == chunk_bytes
    # the stored chunks of the changed tensor, and the gaps between them that a coalesced ranged GET reads through
    assert chunk_bytes <= data <= chunk_bytes + MAX_GAP_BYTES * (n_chunks - 1), (data, chunk_bytes)
    total = proxy.bytes_out["GET"]
    assert total <= data + metadata + (64 << 10)
    assert metadata < 64 << 10  # markers, manifests and listings: a small constant
    assert proxy.requests["GET"] <= 16 + total / (8 << 20), dict(proxy.requests)  # GETs follow the bytes, not the chunks
    report = {
        "requests": dict(proxy.requests),
        "bytes_read_total": total,
        "changed_chunk_bytes": chunk_bytes,
        "changed_chunks": n_chunks,
        "chunk_gets": len(chunk_gets),
        "metadata_bytes": metadata,
        "full_checkpoint_bytes": full,
    }
    (tmp_path / "pull-report.json").write_text(json.dumps(report, indent=1))
    print("pull report:", json.dumps(report))


@pytest.mark.faults(component="network", outcome="retried; publish and refit bit-exact")
def test_transient_5xx_throttling_and_resets_are_retried_to_a_bit_exact_refit(proxied_s3, tmp_path):
    proxy = proxied_s3
    root = f"s3://{S3_BUCKET}/flaky-{uuid.uuid4().hex[:8]}"
    opts = PublishOptions(chunk_bytes=64 << 10, cache_dir=str(tmp_path / "cache"))
    count = {"n": 0}
    kinds = ["503", "500", "reset"]

    def every_fifth(method, path):
        count["n"] += 1
        return kinds[count["n"] % 3] if count["n"] % 5 == 0 else None

    proxy.fault = every_fifth
    so = proxy.storage_options
    base = _model(2)
    run_publish(root, base, 0, storage_options=so, options=opts)
    new = _step(base, 0.02, seed=3)
    run_publish(root, new, 1, storage_options=so, options=opts)
    state = tmp_path / "s.safetensors"
    run_receive(root, "rx", str(state), storage_options=so)
    assert_bits_equal(load_file(state), new)
    injected = [entry for entry in proxy.log if entry[2] in (0, 500, 503)]
    assert len(injected) >= 10, "faults were really injected"


@pytest.mark.parametrize("fault,final", [("500", False), ("503", False), ("reset", False), ("403", True)])
def test_one_owner_retries_each_request_a_bounded_number_of_times(proxied_s3, fault, final):
    """s3fs and botocore are told not to retry, so a request that keeps failing reaches the wire
    as often as DCR's policy tries it (5), not 5 x 5 x 4; a final answer is tried once. (A reset
    connection: aiohttp reopens a pooled keep-alive connection the server closed once per request,
    a reconnect rather than a retry policy, so at most twice per attempt.)"""
    from storage.retry import RetryPolicy
    from storage.root import Root

    proxy = proxied_s3
    root = Root(f"s3://{S3_BUCKET}/owner-{uuid.uuid4().hex[:8]}", proxy.storage_options)
    root.write("x.bin", b"payload")
    root.retry = RetryPolicy(attempts=5, base_delay=0.0)
    proxy.log.clear()
    proxy.fault = lambda method, path: fault if path.endswith("/x.bin") and method == "GET" else None
    with pytest.raises((OSError, Exception)):
        root.read("x.bin")
    proxy.fault = None
    wire = [e for e in proxy.log if e[1].endswith("/x.bin") and e[0] == "GET"]
    if fault == "reset":
        assert 5 <= len(wire) <= 10, wire
    else:
        assert len(wire) == (1 if final else 5), wire


@pytest.mark.slow
def test_sixteen_receiver_processes_follow_a_publisher_on_the_s3_server(s3_server, tmp_path):
    """16 ``dcr receive --follow`` processes pull every step while the publisher keeps publishing:
    all end bit-exact at the last step, the publisher is never held up (receivers write nothing it
    reads), and the aggregate pull throughput is reported."""
    import time

    root = f"s3://{S3_BUCKET}/load-{uuid.uuid4().hex[:8]}"
    opts = PublishOptions(chunk_bytes=64 << 10, cache_dir=str(tmp_path / "cache"))
    cks = [_model(5)]
    last = 6
    for s in range(1, last + 1):
        cks.append(_step(cks[-1], 0.03, seed=100 + s))
    t = time.perf_counter()
    run_publish(root, cks[0], 0, options=opts)
    alone = time.perf_counter() - t
    env = {**os.environ, "DCR_ORCHESTRATOR": "none"}
    n = 16
    t0 = time.perf_counter()
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "flows.cli", "receive", root, "--receiver", f"rx{i}",
             "--state", str(tmp_path / f"rx{i}.safetensors"), "--follow", "--interval", "0.2",
             "--until-step", str(last), "--json", "--io-workers", "4"],
            env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for i in range(n)
    ]
    deadline = time.time() + 300
    while len(Catalog(Root(root)).receivers(0)) < n and time.time() < deadline:
        time.sleep(0.2)  # every receiver process is up and holds step 0
    publish_s = []
    for s in range(1, last + 1):
        time.sleep(1.0)  # pacing, not ordering: the receivers keep polling while steps arrive
        t = time.perf_counter()
        run_publish(root, cks[s], s, options=opts)
        publish_s.append(time.perf_counter() - t)
    t_last = time.perf_counter()
    outs = [p.communicate(timeout=600) for p in procs]
    wall = time.perf_counter() - t0
    catch_up = time.perf_counter() - t_last
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err
    pulled = refits = 0
    for i, (out, _) in enumerate(outs):
        assert_bits_equal(load_file(tmp_path / f"rx{i}.safetensors"), cks[last])
        dec, pos, out = json.JSONDecoder(), 0, out.strip()
        while pos < len(out):  # one JSON document per refit applied
            res, pos = dec.raw_decode(out, pos)
            pos += len(out[pos:]) - len(out[pos:].lstrip())
            if res["from_step"] is not None:  # a delta refit (the first one loads the keyframe)
                pulled += res["bytes_pulled"]
                refits += 1
    assert sorted(Catalog(Root(root)).receivers(last)) == sorted(f"rx{i}" for i in range(n))
    report = {
        "receivers": n, "delta_steps": last, "delta_refits": refits, "delta_bytes_pulled": pulled,
        "wall_s": round(wall, 2), "last_step_committed_to_all_receivers_exact_s": round(catch_up, 2),
        "publish_s_with_receivers": [round(x, 3) for x in publish_s], "keyframe_publish_s_alone": round(alone, 3),
    }
    (tmp_path / "load-report.json").write_text(json.dumps(report, indent=1))
    print("load report:", json.dumps(report))
    assert refits >= n  # every receiver applied deltas (usually one refit per step)


@pytest.mark.backend
@pytest.mark.faults(component="network", outcome="the follower waits, says so, and catches up bit-exact")
def test_a_follower_rides_out_an_endpoint_outage_and_says_so(s3_server, tmp_path):
    """The endpoint refuses every connection (the proxy in front of it is gone) while the publisher
    commits a step, until the follower has retried twice: ``dcr receive --follow`` reports each retry on stderr, backs off, and
    applies every step once the endpoint is back."""
    import socket

    root = f"s3://{S3_BUCKET}/outage-{uuid.uuid4().hex[:8]}"
    opts = PublishOptions(chunk_bytes=64 << 10, cache_dir=str(tmp_path / "cache"))
    cks = [_model(8)]
    for s in (1, 2):
        cks.append(_step(cks[-1], 0.02, seed=200 + s))
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proxy = Proxy(s3_server, port=port)
    run_publish(root, cks[0], 0, options=opts)
    state = tmp_path / "s.safetensors"
    follower = subprocess.Popen(
        [sys.executable, "-m", "flows.cli", "receive", root, "--receiver", "rx", "--state", str(state), "--follow",
         "--interval", "0.2", "--until-step", "2", "--storage-option", f"endpoint_url={proxy.url}"],
        env={**os.environ, "DCR_ORCHESTRATOR": "none", "DCR_FAILPOINTS": "follow.waiting=report"}, cwd=REPO,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    lines = Lines(follower.stderr)
    try:
        lines.wait_for(reported("follow.waiting"))  # it holds step 0 and polls
        proxy.close()  # the outage: connection refused
        run_publish(root, cks[1], 1, options=opts)
        lines.wait_for("retrying in", count=2)  # it has seen the outage twice, and said so
        proxy = Proxy(s3_server, port=port)  # back
        run_publish(root, cks[2], 2, options=opts)
        assert follower.wait(timeout=180) == 0, lines.text()
    finally:
        if follower.poll() is None:
            follower.kill()
        proxy.close()
    err = lines.text()
    retries = [line for line in err.splitlines() if "retrying in" in line]
    assert len(retries) >= 2 and all(line.startswith("dcr: receive:") for line in retries), err
    assert_bits_equal(load_file(state), cks[2])


@pytest.mark.faults(component="bad input or damaged bucket", outcome="refused; at most the limit plus one byte crossed the wire")
def test_an_oversized_marker_is_refused_after_a_ranged_read_on_the_wire(proxied_s3, tmp_path):
    """A 32 MiB ``commit.json`` (the limit is 1 MiB): the receiver refuses it with one line, and the
    proxy saw at most 1 MiB + 1 byte of it go by."""
    proxy = proxied_s3
    so = proxy.storage_options
    root = f"s3://{S3_BUCKET}/big-{uuid.uuid4().hex[:8]}"
    run_publish(root, _model(3), 0, storage_options=so, options=PublishOptions(cache_dir=str(tmp_path / "cache")))
    Root(root, so).write(layout.commit_key(1), b" " * (32 << 20))
    proxy.reset_counts()
    with pytest.raises(Exception, match="more than the 1048576 bytes"):
        run_receive(root, "rx", str(tmp_path / "s.safetensors"), storage_options=so)
    marker_gets = [e for e in proxy.log if e[0] == "GET" and e[1].split("?")[0].endswith(layout.commit_key(1))]
    assert marker_gets and all(e[3] <= (1 << 20) + 1 for e in marker_gets), marker_gets
