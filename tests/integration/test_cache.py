"""DCR's local cache: ``dcr cache ls`` says what it holds and for which ROOT; ``dcr cache prune`` and
every publish keep it within its bound, never touching an entry in use or the one just written."""

from __future__ import annotations

import fcntl
import json
import os
import shutil

import torch

from flows import run_publish, run_receive
from tests.support.cli import dcr
from tests.support.helpers import write_safetensors


def _ck(seed: int, n: int = 50_000) -> dict[str, torch.Tensor]:
    return {"w": torch.randn(n, generator=torch.Generator().manual_seed(seed))}


def _publish_two_steps(root, tmp_path, seed: int) -> None:
    for step in (0, 1):
        run_publish(str(root), _ck(seed + step), step)


def test_cache_ls_names_each_entry_its_root_and_step(tmp_path):
    cache = os.environ["DCR_CACHE_DIR"]
    _publish_two_steps(tmp_path / "a", tmp_path, 1)
    _publish_two_steps(tmp_path / "b", tmp_path, 5)
    listed = json.loads(dcr("cache", "ls", "--json", check=0).stdout)
    assert listed["cache_dir"] == cache
    roots = {e["root"]: e for e in listed["entries"]}
    assert set(roots) == {str(tmp_path / "a"), str(tmp_path / "b")}
    assert all(e["step"] == 1 and e["kind"] == "publisher baseline" and e["nbytes"] >= 200_000 for e in roots.values())
    human = dcr("cache", "ls", check=0).stdout
    assert str(tmp_path / "a") in human and f"cache {cache}:" in human and "2 entries" in human


def test_prune_removes_entries_of_gone_roots_first_then_the_least_recently_used(tmp_path):
    for name, seed in (("a", 1), ("b", 5), ("c", 9)):
        _publish_two_steps(tmp_path / name, tmp_path, seed)
    shutil.rmtree(tmp_path / "b")  # its ROOT is gone: its entry goes whatever the bound
    out = dcr("cache", "prune", "--max-bytes", "1G", check=0).stdout
    assert f"its ROOT {tmp_path / 'b'} no longer exists" in out and out.count("removed ") == 1
    entries = json.loads(dcr("cache", "ls", "--json", check=0).stdout)["entries"]
    assert {e["root"] for e in entries} == {str(tmp_path / "a"), str(tmp_path / "c")}
    a = next(e for e in entries if e["root"] == str(tmp_path / "a"))
    os.utime(os.path.join(a["path"], "baseline.safetensors"), (1, 1))  # a: used longest ago
    for f in os.listdir(a["path"]):
        os.utime(os.path.join(a["path"], f), (1, 1))
    dry = dcr("cache", "prune", "--max-bytes", str(a["nbytes"] + 1000), "--dry-run", check=0).stdout
    assert "would remove" in dry and a["path"] in dry and dry.count("would remove") == 1
    assert os.path.exists(a["path"])
    dcr("cache", "prune", "--max-bytes", str(a["nbytes"] + 1000), check=0)
    assert [e["root"] for e in json.loads(dcr("cache", "ls", "--json", check=0).stdout)["entries"]] == [str(tmp_path / "c")]
    out = dcr("cache", "prune", "--max-bytes", "lots", check=2)
    assert "--max-bytes='lots' is not a size" in out.stderr


def test_an_entry_in_use_is_kept_and_a_pruned_one_costs_only_a_rebuild(tmp_path):
    _publish_two_steps(tmp_path / "a", tmp_path, 1)
    entry = json.loads(dcr("cache", "ls", "--json", check=0).stdout)["entries"][0]["path"]
    with open(os.path.join(entry, "baseline.safetensors"), "rb") as held:  # as a publisher encoding against it
        fcntl.flock(held.fileno(), fcntl.LOCK_SH)
        out = dcr("cache", "prune", "--max-bytes", "0", check=0).stdout
    assert f"kept {entry}: in use" in out and os.path.exists(entry)
    dcr("cache", "prune", "--max-bytes", "0", check=0)
    assert not os.path.exists(entry)
    run_publish(str(tmp_path / "a"), _ck(3), 2)  # rebuilt from ROOT, exact
    state = tmp_path / "s.safetensors"
    run_receive(str(tmp_path / "a"), "r", str(state))
    from safetensors.torch import load_file

    from tests.support.helpers import assert_bits_equal

    assert_bits_equal(load_file(state), _ck(3))


def test_a_publish_keeps_the_cache_within_its_bound_and_its_own_baseline(tmp_path, monkeypatch):
    _publish_two_steps(tmp_path / "a", tmp_path, 1)
    monkeypatch.setenv("DCR_CACHE_MAX_BYTES", "300K")  # one baseline fits, two do not
    write_safetensors(tmp_path / "b0.safetensors", _ck(7))
    dcr("publish", tmp_path / "b", tmp_path / "b0.safetensors", "--step", 0, check=0)
    entries = json.loads(dcr("cache", "ls", "--json", check=0).stdout)["entries"]
    assert [e["root"] for e in entries] == [str(tmp_path / "b")]
    monkeypatch.setenv("DCR_CACHE_MAX_BYTES", "0")  # even below its own size, the new baseline stays
    write_safetensors(tmp_path / "b1.safetensors", _ck(8))
    dcr("publish", tmp_path / "b", tmp_path / "b1.safetensors", "--step", 1, check=0)
    assert [e["step"] for e in json.loads(dcr("cache", "ls", "--json", check=0).stdout)["entries"]] == [1]


def test_a_receiver_mirror_whose_receive_holds_its_lock_and_a_first_publish_in_progress_are_kept(tmp_path):
    """A receiver mirror whose state lock a receive holds is kept (the lock taken, not its file
    merely looked for); so is a publisher's entry that has no baseline yet but a file just written
    (a first publish writing it)."""
    from storage.local import cache, state

    cache_dir = tmp_path / "cache"
    mirror = cache_dir / "receivers" / ("0" * 16) / "rx.safetensors"
    mirror.parent.mkdir(parents=True)
    write_safetensors(mirror, {"w": torch.zeros(1000)})
    first = cache_dir / ("1" * 16)
    first.mkdir()
    (first / ".baseline.safetensors.tmp-0").write_bytes(bytes(4000))
    with state.exclusive(mirror):
        report = cache.prune(str(cache_dir), max_bytes=0)
    assert sorted(report.skipped) == sorted([str(mirror), str(first)]) and report.removed == []
    assert mirror.exists() and first.exists()
    report = cache.prune(str(cache_dir), max_bytes=0)
    assert not mirror.exists() and [r["path"] for r in report.removed] == [str(mirror)]
