"""``Publisher``: a long-running trainer's handle that keeps the committed policy in memory as the
next delta's baseline.

``run_publish`` alone reads the base step's bits from a local baseline file (verified, then read
and re-checked again while encoding) and rewrites that file after each commit: O(model) disk work
and digests per refit. A ``Publisher`` keeps the snapshot it has just committed instead (a private
bit copy whose digests it computed itself) and uses it as the next baseline when it is exactly the
plan's base: same ROOT, step and policy digest. Otherwise (another publisher committed in between,
a keyframe started a new lineage, the process restarted) the baseline comes from the file cache or
is rebuilt from ROOT, as ``run_publish`` does. Its steps run in-process by default; pass
``runner=flows.PrefectRunner()`` inside a Prefect flow to run them as tasks.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from dcr_core.errors import UsageError
from flows.options import PublishOptions
from flows.publish.baseline import BaselineSlot
from flows.publish.pipeline import run_publish
from flows.publish.shards import ShardedSource
from flows.results import PublishResult
from flows.steps import Runner
from storage import layout


class Publisher:
    """Publish successive steps to one ROOT from a long-running process (a trainer).

    ``publish(tensors, step)`` snapshots ``tensors`` (a name -> tensor mapping), publishes it and,
    once it is committed, keeps the snapshot as the next delta's baseline: no baseline file is read
    or written while the held baseline is the latest step. Memory: this costs one extra copy of the
    canonical model in host memory; while a delta is encoded the held baseline and the new snapshot
    both exist, and the old baseline is dropped after the commit. A publish that fails anywhere
    keeps the previous baseline. A checkpoint path (its owner may overwrite the file) or another
    source object is published as ``run_publish`` does, with the baseline file, and not held;
    sharded sources are passed to ``run_publish`` as they are. One publish at a time.

    ``storage_options`` may be replaced between publishes (the same ROOT through another endpoint):
    the held baseline is matched by ROOT URL, step and policy digest.
    """

    def __init__(self, root: str | os.PathLike, storage_options: dict | None = None,
                 options: PublishOptions | None = None, runner: Runner | None = None):
        if not isinstance(root, (str, os.PathLike)) or not os.fspath(root):
            raise UsageError(f"Publisher root must be a non-empty path or URL, got {root!r}")
        if storage_options is not None and not isinstance(storage_options, Mapping):
            raise UsageError(f"storage_options must be a mapping, got {type(storage_options).__name__}")
        if options is not None and not isinstance(options, PublishOptions):
            raise UsageError(f"options must be a PublishOptions, got {type(options).__name__}")
        self.root = os.fspath(root)
        self.storage_options = dict(storage_options or {})
        self.options = options or PublishOptions()
        self.runner = runner
        self._slot = BaselineSlot()

    @property
    def step(self) -> int | None:
        """The step whose bits are held in memory as the next baseline (None: none held)."""
        held = self._slot.baseline
        return None if held is None else held.step

    def publish(self, source, step: int, keyframe: bool = False) -> PublishResult:
        """Publish ``source`` as ``step`` (see ``run_publish``); a mapping's snapshot is then held."""
        layout.check_step(step)
        if not isinstance(keyframe, bool):
            raise UsageError(f"keyframe must be True or False, got {keyframe!r}")
        if isinstance(source, ShardedSource) or (
            isinstance(source, (list, tuple)) and any(isinstance(s, ShardedSource) for s in source)
        ):
            result = run_publish(self.root, source, step, keyframe, self.storage_options, self.options, self.runner)
            self._slot.baseline = None  # stale now (ranks keep their own baselines): free its memory
            return result
        return run_publish(self.root, source, step, keyframe, self.storage_options, self.options, self.runner,
                           held=self._slot)
