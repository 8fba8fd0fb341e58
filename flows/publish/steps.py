"""The publisher's steps for a canonical source, in the order ``flows.publish.pipeline`` runs them.

Torch-free: a checkpoint path is read as raw bits. A rank of a sharded publish (training shards,
torch) runs the table of ``flows.publish.rank_steps``."""

from __future__ import annotations

from flows.publish import baseline, commit, encode, sources
from flows.publish.plan import plan_from_source
from flows.steps import Step, StepTable

PUBLISH = StepTable(
    # a canonical source (a checkpoint, or tensors in memory)
    Step("snapshot", sources.snapshot),
    Step("plan-publish", plan_from_source),
    Step("load-baseline", baseline.load_baseline),
    Step("encode-and-write-chunks", encode.encode_and_write),
    Step("encode-group", encode.encode_group),  # mapped over tensor groups on workers (flows.workers)
    Step("write-snapshot", encode.write_snapshot),
    Step("write-manifest", commit.write_manifest),
    Step("commit", commit.commit_step),
    Step("remember-baseline", baseline.remember_baseline),
)
