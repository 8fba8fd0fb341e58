"""The publisher's steps, in the order the pipelines run them (``flows.publish.pipeline``)."""

from __future__ import annotations

from flows.publish import baseline, commit, encode, ranks, shard_baseline, shards, sources
from flows.publish.plan import plan_from_source
from flows.steps import Step, StepTable

PUBLISH = StepTable(
    # a canonical source (a checkpoint, or tensors in memory)
    Step("snapshot", sources.snapshot),
    Step("plan-publish", plan_from_source),
    Step("load-baseline", baseline.load_baseline),
    Step("encode-and-write-chunks", encode.encode_and_write),
    Step("write-snapshot", encode.write_snapshot),
    Step("write-manifest", commit.write_manifest),
    Step("commit", commit.commit_step),
    Step("remember-baseline", baseline.remember_baseline),
    # a rank of a sharded publish (training shards)
    Step("snapshot-shards", shards.snapshot_shards),
    Step("plan-rank", ranks.plan_rank),
    Step("load-shard-baseline", shard_baseline.load_shard_baseline),
    Step("encode-rank-shards", ranks.encode_rank),
    Step("stage-shard-baseline", shard_baseline.stage_shard_baseline),
    Step("merge-and-commit", ranks.commit_ranks),
    Step("await-commit", ranks.await_commit),
    Step("keep-shard-baseline", shard_baseline.keep_shard_baseline),
)
