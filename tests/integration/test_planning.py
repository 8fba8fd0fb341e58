"""The direct planner reads only the steps between and agrees with the general planner."""

from __future__ import annotations

import random

import pytest
import torch

from dcr_core.chain import StepInfo, plan_direct, plan_path
from flows import run_publish, run_receive
from flows.options import PublishOptions
from storage.catalog import Catalog
from storage.root import Root
from storage.stats import io_stats


def _random_forest(rng: random.Random, n: int) -> dict[int, StepInfo]:
    steps: dict[int, StepInfo] = {}
    for s in range(n):
        keyframe = s == 0 or rng.random() < 0.15
        base = None if keyframe else rng.choice([x for x in steps if x < s][-3:])  # mostly the latest
        steps[s] = StepInfo(s, base, rng.random() < 0.85, rng.randint(1, 100) if not keyframe else rng.randint(50, 400))
    return steps


def _keyframe_cost(steps, s):
    cost = 0
    while s is not None:
        cost += steps[s].stored_bytes
        s = steps[s].base_step
    return cost


@pytest.mark.parametrize("seed", range(30))
def test_direct_plans_equal_the_general_planner_whenever_they_exist(seed):
    rng = random.Random(seed)
    steps = _random_forest(rng, 25)
    found = 0
    for current in [None, *steps]:
        for target in steps:
            direct = plan_direct(steps.__getitem__, current, target, _keyframe_cost(steps, target))
            if direct is not None:
                found += 1
                assert direct == plan_path(steps, current, target), (current, target)
    assert found > 25


def test_a_one_step_refit_at_the_end_of_a_long_chain_reads_a_constant_number_of_objects(tmp_path):
    root = str(tmp_path / "bucket")
    g = torch.Generator().manual_seed(0)
    ck = {"w": torch.randn(64, 64, generator=g).bfloat16()}
    opts = PublishOptions(cache_dir=str(tmp_path / "c"))
    for s in range(30):
        ck = {"w": ck["w"].clone()}
        ck["w"].view(-1).view(torch.int16)[s] ^= 1
        run_publish(root, ck, s, options=opts)
    state = str(tmp_path / "s.safetensors")
    run_receive(root, "r", state, 28)
    before = io_stats(root)
    res = run_receive(root, "r", state, 29)
    used = io_stats(root).minus(before)
    assert res.moves == ["forward:29"]
    # markers of 28 and 29, their two manifests, the chunk, a listing or two: not 30 markers
    assert used.gets <= 8, used
    assert Catalog(Root(root)).marker(29).summary["keyframe_step"] == 0
