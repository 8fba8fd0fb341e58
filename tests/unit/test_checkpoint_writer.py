"""The streaming safetensors writer: durable by default, and without fsync only where asked."""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file

from dcr_core.bits import infos_of
from storage.local import safetensors as checkpoint
from storage.local.safetensors import StreamingSafetensorsWriter


def _tensors():
    g = torch.Generator().manual_seed(1)
    return {"a": torch.randn(33, 7, generator=g).bfloat16(), "b": torch.arange(5, dtype=torch.int64)}


@pytest.fixture
def fsyncs(monkeypatch):
    calls = []
    real = os.fsync
    monkeypatch.setattr(checkpoint.os, "fsync", lambda fd: (calls.append("file"), real(fd))[1])
    monkeypatch.setattr(checkpoint, "fsync_dir", lambda d: calls.append("dir"))
    return calls


def _write(path, durable: bool | None) -> None:
    ts = _tensors()
    infos = infos_of(ts)
    names = sorted(ts)
    kw = {} if durable is None else {"durable": durable}
    w = StreamingSafetensorsWriter(path, [infos[n] for n in names], {"k": "v"}, **kw)
    for n in names:
        w.write(n, ts[n].contiguous().view(torch.uint8).numpy())
    w.commit()


def test_the_writer_is_durable_by_default(tmp_path, fsyncs):
    _write(tmp_path / "x.safetensors", None)
    assert fsyncs == ["file", "dir"]


def test_a_non_durable_write_skips_fsync_and_writes_the_same_bytes(tmp_path, fsyncs):
    _write(tmp_path / "durable.safetensors", True)
    fsyncs.clear()
    _write(tmp_path / "cache.safetensors", False)
    assert fsyncs == []
    assert (tmp_path / "cache.safetensors").read_bytes() == (tmp_path / "durable.safetensors").read_bytes()
    back = load_file(str(tmp_path / "cache.safetensors"))
    assert all(torch.equal(back[n].view(torch.uint8), t.view(torch.uint8)) for n, t in _tensors().items())
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temp file left


def test_publisher_cache_is_not_fsynced_but_receiver_state_is(tmp_path, monkeypatch):
    from flows import PublishOptions, run_publish, run_receive

    made = []
    init = StreamingSafetensorsWriter.__init__

    def spy(self, path, *args, **kwargs):
        init(self, path, *args, **kwargs)
        made.append((os.path.basename(self.path), self.durable))

    monkeypatch.setattr(StreamingSafetensorsWriter, "__init__", spy)
    root, state = str(tmp_path / "root"), str(tmp_path / "state.safetensors")
    opts = PublishOptions(chunk_bytes=4096, cache_dir=str(tmp_path / "cache"))
    old = _tensors()
    new = {n: t.clone() for n, t in old.items()}
    new["a"].view(torch.int16).view(-1)[::5] ^= 1
    run_publish(root, old, 0, keyframe=True, options=opts)
    run_publish(root, new, 1, options=opts)
    # The cache (verified on use): written by the keyframe, then patched in place by the delta.
    assert made == [("baseline.safetensors", False)]
    made.clear()
    run_receive(root, "r", state, 1)
    assert made == [("state.safetensors", True)]
    back = load_file(state)
    assert all(torch.equal(back[n].view(torch.uint8), t.view(torch.uint8)) for n, t in new.items())


def test_a_reserved_file_written_out_of_order_at_its_offsets_is_the_streamed_file(tmp_path):
    """``reserve`` + ``write_at`` (how tasks on workers fill a file, in any order): byte for byte
    the file the writer streams in order; a file not there fails naming it."""
    _write(tmp_path / "streamed.safetensors", True)
    ts = _tensors()
    infos = infos_of(ts)
    names = sorted(ts)
    w = StreamingSafetensorsWriter(tmp_path / "placed.safetensors", [infos[n] for n in names], {"k": "v"})
    offsets = w.reserve()
    tmp = w.finish()
    assert os.path.getsize(tmp) == w.size
    for n in reversed(names):  # each "task" writes its own tensor, last first
        checkpoint.write_at(tmp, offsets, [(n, ts[n].contiguous().view(torch.uint8).numpy())])
    checkpoint.install(tmp, str(tmp_path / "placed.safetensors"))
    assert (tmp_path / "placed.safetensors").read_bytes() == (tmp_path / "streamed.safetensors").read_bytes()
    with pytest.raises(FileNotFoundError, match="gone"):
        checkpoint.write_at(str(tmp_path / "gone"), offsets, [])


def test_byte_batches_are_consecutive_runs_of_about_the_target():
    from dcr_core.batches import byte_batches

    sizes = [("a", 5), ("b", 5), ("c", 20), ("d", 1), ("e", 1), ("f", 9)]
    assert byte_batches(sizes, 10) == [["a", "b"], ["c"], ["d", "e", "f"]]
    assert byte_batches(sizes, 1) == [[k] for k, _ in sizes]  # every item its own batch
    assert byte_batches(sizes, 10**9) == [[k for k, _ in sizes]]
    assert byte_batches([], 10) == []
    assert [k for run in byte_batches(sizes, 7) for k in run] == [k for k, _ in sizes]  # order kept, nothing lost
