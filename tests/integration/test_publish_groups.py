"""A publish mapped over groups of tensors, with the mapped calls run here as workers would run
them: groups that see the publisher's baseline cache log their changes (the cache is patched with
all the logs), groups that cannot rebuild their tensors' baseline from ROOT; what is stored equals
a publish in one process. (The groups on real Dask workers: tests/system/test_workers.py.)"""

from __future__ import annotations

import os
import tempfile

import pytest

from dcr_core import events
from flows.options import PublishOptions
from flows.publish.pipeline import run_publish
from flows.receive.pipeline import run_receive
from storage import stream
from storage.catalog import Catalog
from storage.root import Root
from tests.support.helpers import assert_bits_equal, attempt_objects, chain_of_steps, read_state, write_safetensors


class Groups:
    """A mapping runner that calls the mapped step here, in turn, as Dask workers would (stands in
    for a cluster: the code paths under test are the tasks', not the cluster's). ``cache_seen``:
    False passes the baseline path as a worker on another machine sees it: absent."""

    mapped = True
    slots = 2

    def __init__(self, cache_seen: bool):
        self.cache_seen = cache_seen

    def wrap(self, step):
        return step.fn

    def map(self, step, items, shared, each=None):
        if not self.cache_seen and shared.get("baseline") is not None:
            shared = {**shared, "baseline": "/nonexistent/dcr-cache.safetensors"}
        out = []
        for item in items:
            out.append(step.fn(**shared, **item))
            if each is not None:
                each(out[-1])
        return out


@pytest.mark.parametrize(("cache_seen", "relative"), [(True, False), (True, True), (False, False)],
                         ids=["cache-seen", "cache-seen-relative-paths", "cache-out-of-reach"])
def test_groups_store_what_one_process_stores_and_keep_the_cache(tmp_path, monkeypatch, cache_seen, relative):
    """Groups that see the publisher's cache each log their changes and the cache is patched with
    every group's log after the commit; groups that cannot see it rebuild their tensors' baseline
    from ROOT (and the cache is copied whole). Either way the stored objects equal one process's."""
    paths = []
    for i, ck in enumerate(chain_of_steps(4, seed=11, ulps=0.5, big=300)):
        paths.append(str(tmp_path / f"ck{i}.safetensors"))
        write_safetensors(paths[-1], ck)
    seen: dict[str, list] = {"publish.group-baseline-rebuilt": [], "publish.baseline-kept": []}

    def listener(point: str, fields: dict) -> None:
        if point in seen:
            seen[point].append(fields)

    here, grouped = str(tmp_path / "here"), str(tmp_path / "grouped")
    cache = str(tmp_path / "c2")
    if relative:  # ROOT and cache named relative to the publisher's directory: the workers get absolute paths
        monkeypatch.chdir(tmp_path)
        grouped, cache = "grouped", "c2"
    with events.listening(listener):
        for step, path in enumerate(paths):
            opts = {"chunk_bytes": 1 << 12}
            run_publish(here, path, step, options=PublishOptions(cache_dir=str(tmp_path / "c1"), **opts))
            seen["publish.baseline-kept"].clear()
            res = run_publish(grouped, path, step, options=PublishOptions(cache_dir=cache, group_bytes=8 << 10, **opts),
                              runner=Groups(cache_seen))
            kept = seen["publish.baseline-kept"]
            assert len(kept) == 1
            if step > 0:  # a delta: the cache patched from the groups' logs, or copied whole
                assert ("patched" in kept[0]) == cache_seen, kept
            held = [os.path.join(d, f) for d, _, fs in os.walk(cache) for f in fs if f == "baseline.safetensors"]
            assert len(held) == 1 and read_state(held[0]).keys() == read_state(path).keys()
            assert_bits_equal(read_state(held[0]), read_state(path))
            assert not [f for d, _, fs in os.walk(cache) for f in fs if f.endswith(".patch")], "a log was left"
            assert res["step"] == step
    rebuilt = seen["publish.group-baseline-rebuilt"]
    if cache_seen:
        assert rebuilt == []
    else:
        assert {r["step"] for r in rebuilt} == {1, 2, 3} and len(rebuilt) > 6  # every group of each delta
    for step in range(4):
        assert attempt_objects(grouped, step) == attempt_objects(here, step)
        m = Catalog(Root(grouped)).manifest(step)  # each group's chunks announced with their packs' sizes
        announced, seq = {}, 0
        while (idx := stream.read_index(Root(grouped), step, m.attempt, seq)) is not None:
            announced.update({c.pack: c.pack_bytes for c in idx.chunks})
            seq += 1
        assert announced == m.packs() != {}
    state = str(tmp_path / "state.safetensors")
    run_receive(grouped, "r", state)
    assert_bits_equal(read_state(state), read_state(paths[-1]))
    assert not [f for f in os.listdir(tempfile.gettempdir()) if f.startswith("dcr-group-baseline-")]
