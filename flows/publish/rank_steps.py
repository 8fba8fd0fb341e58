"""The steps of one rank of a sharded publish, in the order ``flows.publish.rank_pipeline`` runs them
(training shards: torch; the canonical publish's table, torch-free, is ``flows.publish.steps``)."""

from __future__ import annotations

from flows.publish import ranks, shard_baseline, shards
from flows.steps import Step, StepTable

RANK_PUBLISH = StepTable(
    Step("snapshot-shards", shards.snapshot_shards),
    Step("plan-rank", ranks.plan_rank),
    Step("load-shard-baseline", shard_baseline.load_shard_baseline),
    Step("encode-rank-shards", ranks.encode_rank),
    Step("stage-shard-baseline", shard_baseline.stage_shard_baseline),
    Step("merge-and-commit", ranks.commit_ranks),
    Step("await-commit", ranks.await_commit),
    Step("keep-shard-baseline", shard_baseline.keep_shard_baseline),
)
