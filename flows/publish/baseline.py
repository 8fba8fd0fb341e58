"""The publisher's baseline: the base step's bits that a delta is computed against.

Where it comes from, cheapest first:
1. held in memory (``HeldBaseline``): a long-running ``Publisher`` keeps the snapshot it has just
   committed; used only when it is exactly the plan's base (same ROOT, step and policy digest) and
   not re-checked (its digests are the ones this process computed from that very private copy);
2. the local baseline cache (``<cache_dir>/<ROOT key>/baseline.safetensors``), checked tensor by
   tensor against the base step's digests before use (and again as it is read while encoding);
3. rebuilt from ROOT through the shared reader (keyframe plus deltas, streamed), into the cache.
After the commit the published policy becomes the next baseline (in memory or in the cache).
"""

from __future__ import annotations

import logging
import os
import tempfile
from dataclasses import dataclass

import blake3

from dcr_core import events
from dcr_core.chain import KEYFRAME
from dcr_core.errors import DCRError
from flows import refs
from flows.publish.plan import PublishPlan
from flows.publish.sources import Source, SourceRef, open_source, opened
from flows.refs import LocalRef
from storage import reader
from storage.local import state
from storage.local.safetensors import SafetensorsCheckpoint, StreamingSafetensorsWriter
from storage.marker import CommitMarker
from storage.root import open_root

log = logging.getLogger("dcr.publish")

BASELINE_FILE = "baseline.safetensors"


def cache_path(plan: PublishPlan, file_name: str = BASELINE_FILE) -> str:
    """A file of this ROOT's publisher cache (keyed by the ROOT URL)."""
    key = blake3.blake3(plan.root.url.encode()).hexdigest()[:16]
    return os.path.join(plan.options.cache_dir, key, file_name)


@dataclass(frozen=True)
class HeldBaseline:
    """A committed step's bits kept in memory by the process that committed them (see module doc)."""

    root_url: str
    step: int
    policy_digest: str
    source: Source

    def is_base_of(self, plan: PublishPlan) -> bool:
        """Exactly the plan's base: same ROOT, step and policy digest (else the baseline is loaded)."""
        return (
            self.root_url == plan.root.url
            and self.step == plan.base_step
            and self.policy_digest == plan.base_policy_digest
            and set(self.source.infos) == set(plan.infos)
        )


@dataclass
class BaselineSlot:
    """Where a long-running publisher keeps its in-memory baseline between publishes
    (``run_publish(held=...)``). ``baseline`` is replaced only once a step is committed, so a
    publish that fails anywhere leaves the previous one."""

    baseline: HeldBaseline | None = None


def _cache_valid(path: str, plan: PublishPlan) -> bool:
    """The cached baseline holds exactly the base step's bits (checked tensor by tensor)."""
    entries = plan.base_entries()
    try:
        ck = SafetensorsCheckpoint(path)
    except (DCRError, OSError):
        return False  # a missing or broken cache is only a cache: it gets rebuilt
    try:
        meta = ck.metadata
        if meta.get(state.STEP) != str(plan.base_step) or meta.get(state.POLICY) != plan.base_policy_digest:
            return False
        if {n: (i.dtype, i.shape) for n, i in ck.infos.items()} != {n: (e.dtype, e.shape) for n, e in entries.items()}:
            return False
        # Checked here (not only on use) so a damaged cache is rebuilt instead of failing the publish.
        return all(entries[n].matches(ck.bits(n)) for n in entries)
    except (DCRError, OSError, ValueError):
        return False
    finally:
        ck.close()


def load_baseline(plan: PublishPlan, held: LocalRef | None = None) -> SourceRef | None:
    """The base step's bits: ``held`` if it is exactly the plan's base, else a local file (the
    cache if it verifies, else rebuilt from ROOT into the cache, or into a private temp file
    without a cache)."""
    if plan.kind == KEYFRAME:
        return None
    if held is not None:
        baseline = refs.get(held)
        if isinstance(baseline, HeldBaseline) and baseline.is_base_of(plan):
            return refs.put(baseline.source, "baseline")
    path = cache_path(plan)
    if plan.options.use_cache and os.path.exists(path) and _cache_valid(path, plan):
        return path
    if not plan.options.use_cache:  # a private temp file, removed once the step is committed
        path = os.path.join(tempfile.gettempdir(), f"dcr-baseline-{plan.attempt}.safetensors")
    rebuild(plan, path)
    return path


def rebuild(plan: PublishPlan, path: str) -> None:
    """Write the base step's bits to ``path`` from ROOT (streamed through the shared reader)."""
    root = open_root(plan.root)
    rplan = reader.plan_refit(root, None, plan.base_step)
    ms = reader.manifests(rplan, root)
    target = ms[plan.base_step]
    infos = [target.tensors[n].info for n in sorted(target.tensors)]
    meta = state.metadata(plan.base_step, target.policy_digest, plan.root.url)
    writer = StreamingSafetensorsWriter(path, infos, meta, durable=False)
    try:
        for name, bits, _ in reader.refit_tensors(root, rplan, ms, None, plan.options.io_workers):
            writer.write(name, bits)
        writer.commit()
    except BaseException:
        writer.abort()
        raise


def remember_baseline(
    plan: PublishPlan, source: SourceRef, marker: CommitMarker, baseline: SourceRef | None = None, hold: bool = False,
) -> LocalRef | None:
    """Keep the committed policy as the next delta's baseline: with ``hold`` (``source`` is a
    snapshot this publish made), in memory (a ``HeldBaseline``, returned); else in the cache file.

    Runs after the commit: a failure here only costs the cache (the next publish rebuilds it)."""
    if isinstance(baseline, str) and not plan.options.use_cache and os.path.exists(baseline):
        os.unlink(baseline)  # the private temp baseline of a --no-cache publish
    if hold:
        held = HeldBaseline(plan.root.url, marker.step, marker.policy_digest, open_source(source))
        events.reached("publish.baseline-kept", step=marker.step, where="memory")
        return refs.put(held, "held")
    if not plan.options.use_cache:
        return None
    names = sorted(plan.infos)
    meta = state.metadata(marker.step, marker.policy_digest, plan.root.url)
    try:
        writer = StreamingSafetensorsWriter(cache_path(plan), [plan.infos[n] for n in names], meta, durable=False)
    except OSError as e:
        log.warning("cannot write the baseline cache (%s); the next delta rebuilds its baseline from ROOT", e)
        return None
    try:
        with opened(source) as src:
            for n in names:  # one tensor at a time
                writer.write(n, src.bits(n))
        writer.commit()
        events.reached("publish.baseline-kept", step=marker.step, where=writer.path)
    except (OSError, DCRError, ValueError) as e:  # the step is committed; only the cache is lost
        writer.abort()
        log.warning("cannot write the baseline cache (%s); the next delta rebuilds its baseline from ROOT", e)
    return None
