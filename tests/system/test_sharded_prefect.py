"""publish_refit with training shards through the Prefect API: each rank's steps as tasks, then the commit."""

from __future__ import annotations

import pytest

from tests.integration.test_sharded_publish import canonical, sources
from tests.support.helpers import assert_bits_equal, next_step, read_state

pytestmark = pytest.mark.prefect


def test_publish_refit_from_all_ranks_shards_is_bit_exact(prefect_settings, tmp_path):
    from flows import publish_refit, receive_refit
    from flows.options import PublishOptions

    root, state = str(tmp_path / "bucket"), str(tmp_path / "s.safetensors")
    opts = PublishOptions(chunk_bytes=32, cache_dir=str(tmp_path / "cache"))
    ck = canonical(11)
    for step in range(2):
        res = publish_refit(root, sources(ck), step, options=opts)
        assert res["kind"] == ("keyframe" if step == 0 else "delta")
        assert {"plan-rank", "encode-rank", "commit-ranks"} <= set(res["timings"])
        receive_refit(root, "r", state)
        assert_bits_equal(read_state(state), ck)
        ck = next_step(ck, 30 + step)
