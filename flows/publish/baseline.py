"""The publisher's baseline: the base step's bits that a delta is computed against.

Where it comes from, cheapest first:
1. held in memory (``HeldBaseline``): a long-running ``Publisher`` keeps the snapshot it has just
   committed; used only when it is exactly the plan's base (same ROOT, step and policy digest) and
   not re-checked (its digests are the ones this process computed from that very private copy);
2. the local baseline cache (``<cache_dir>/<ROOT key>/baseline.safetensors``), see "Trust" below;
3. rebuilt from ROOT through the shared reader (keyframe plus deltas, streamed), into the cache.
After the commit the published policy becomes the next baseline, in memory or in the cache. A delta
encoded against the cache file patches it in place: the encode pass logged the positions and new
bits of every changed element (``storage.local.patch_log``), and only those are written, through the
page cache, with the header's step and policy digest (the cache is unstamped meanwhile, so a crash
there leaves a cache that is hashed in full and rebuilt before its next use). Otherwise (a
keyframe, a baseline held in memory or rebuilt elsewhere, a log that fails its check, a cache whose
header has no room) the checkpoint is copied into a new cache file whole: a checkpoint file's
tensors by the kernel (``copy_file_range``), not through memory.

Trust (the cache must never feed a wrong baseline into a delta, and should cost no pass of its own):
- Every use is checked. The encode pass reads each base tensor anyway (to XOR it against the new
  bits), so it hashes exactly the bits it XORs and compares them with the base step's digest before
  the next tensor (``flows.publish.encode``). A mismatch fails that encode before any manifest is
  written; the pipeline discards the attempt and encodes once more from a baseline checked in full
  now (``recheck``), i.e. rebuilt from ROOT when the file is damaged. Nothing wrong is committed.
- So the up-front check only decides whether that re-encode is likely. A cache is taken without
  hashing when its header names the base step and policy digest with the base's tensors, and its
  stamp (an extended attribute set on the file right after DCR wrote or fully checked it: the step
  and policy digest with the file's device, inode, size and mtime) still describes it. Anything
  else (no stamp, another file, a copy, a rewrite or truncation, a stale step, a file system
  without extended attributes) is hashed tensor by tensor first (``_cache_valid``) and rebuilt from
  ROOT if it fails, as before stamps. A stamp can be fooled (a rewrite within the file system's
  timestamp granularity that keeps the size, or an mtime set back): the check while encoding
  catches that.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import json
import logging
import os
import tempfile
import time
from dataclasses import dataclass

import blake3
import numpy as np

from dcr_core import events
from dcr_core.chain import KEYFRAME
from dcr_core.dtypes import DTYPES
from dcr_core.errors import DCRError
from flows import local_refs
from flows.local_refs import LocalRef
from flows.publish.plan import PublishPlan
from flows.publish.sources import Source, SourceRef, open_source, opened
from storage import reader
from storage.local import bundled, cache, patch_log, safetensors, state
from storage.local.safetensors import SafetensorsCheckpoint, StreamingSafetensorsWriter
from storage.marker import CommitMarker
from storage.root import open_root

log = logging.getLogger("dcr.publish")

BASELINE_FILE = "baseline.safetensors"
STAMP_XATTR = "user.dcr.baseline-stamp"  # on the cache file (see "Trust")
STAMP_FORMAT = "dcr-baseline-stamp"
HASH_BUFFER_BYTES = 4 << 20  # a cache checked in full is read through one buffer of this size


def _root_url(plan: PublishPlan) -> str:
    """The plan's ROOT URL, a local path as its real path (however the publisher or a worker named it)."""
    return plan.root.url if "://" in plan.root.url else os.path.realpath(plan.root.url)


def cache_path(plan: PublishPlan, file_name: str = BASELINE_FILE) -> str:
    """A file of this ROOT's publisher cache (keyed by the ROOT URL; a local path by its real path, so
    ``dcr publish bucket`` and ``dcr publish /abs/bucket`` share one cache)."""
    key = blake3.blake3(_root_url(plan).encode()).hexdigest()[:16]
    return os.path.join(plan.options.cache_dir, key, file_name)


PATCH_LOG_SUFFIX = ".patch"


def patch_log_path(plan: PublishPlan, group: int | None = None) -> str:
    """The log of the elements this attempt changes in the cache (``storage.local.patch_log``); of
    group ``group`` only, for a publish mapped over groups on workers that see the cache."""
    part = "" if group is None else f".g{group}"
    return cache_path(plan, f"{BASELINE_FILE}.{plan.attempt}{part}{PATCH_LOG_SUFFIX}")


def patch_log_head(plan: PublishPlan, group: int | None = None, groups: int | None = None) -> dict:
    """What a patch log says it does: the cache of which ROOT, from which step to which attempt
    (and, a group's log, which group of how many)."""
    head = {"root": _root_url(plan), "from_step": plan.base_step, "from_policy_digest": plan.base_policy_digest,
            "step": plan.step, "attempt": plan.attempt}
    return head if group is None else {**head, "group": group, "groups": groups}


def patch_logs(plan: PublishPlan) -> list[str]:
    """The logs that together patch the cache into this attempt's step: the encode pass's one log,
    or one per group when every group of a mapped publish left one; else none (the cache is then
    copied whole)."""
    whole = patch_log_path(plan)
    if os.path.exists(whole):
        return [whole]
    first = patch_log_path(plan, 0)
    try:
        groups = patch_log.read_head(first).get("groups")
    except (OSError, DCRError):
        return []
    logs = [patch_log_path(plan, g) for g in range(groups if isinstance(groups, int) else 0)]
    return logs if logs and all(os.path.exists(p) for p in logs) else []


def drop_patch_logs(plan: PublishPlan) -> None:
    """Remove this attempt's patch logs, the whole step's and every group's (used or not)."""
    pattern = glob.escape(cache_path(plan, f"{BASELINE_FILE}.{plan.attempt}")) + f"*{PATCH_LOG_SUFFIX}"
    for path in glob.glob(pattern):
        with contextlib.suppress(OSError):
            os.unlink(path)


PATCH_LOG_SHARE = 4  # a log past 1/4 of the checkpoint's bytes: the step changed so much that a copy is cheaper
PATCH_LOG_FLOOR = 1 << 20  # below this, either way costs next to nothing


def patch_log_limit(plan: PublishPlan, nbytes: int | None = None) -> int:
    """The bytes past which a step's patch log (a group's: of ``nbytes`` of tensors) is dropped and
    the cache copied whole instead."""
    total = sum(i.nbytes for i in plan.infos.values()) if nbytes is None else nbytes
    return max(PATCH_LOG_FLOOR, total // PATCH_LOG_SHARE)


STALE_LOG_SECONDS = 3600  # a log unchanged this long belongs to no live publish


def _remove_stale_patch_logs(plan: PublishPlan) -> None:
    """Logs left by publishes that never patched the cache (a failed commit, a crash). Only stale
    ones: a publisher racing this one for the same ROOT may be writing or applying its own now."""
    directory = os.path.dirname(cache_path(plan))
    try:
        names = os.listdir(directory)
    except OSError:
        return
    now = time.time()
    for name in names:
        if name.startswith((f"{BASELINE_FILE}.", f".{BASELINE_FILE}.")) and PATCH_LOG_SUFFIX in name:
            path = os.path.join(directory, name)
            with contextlib.suppress(OSError):
                if now - os.stat(path).st_mtime > STALE_LOG_SECONDS:
                    os.unlink(path)


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


def _file_stamp(path: str, step: int, policy_digest: str) -> bytes:
    st = os.stat(path)
    return json.dumps({"format": STAMP_FORMAT, "step": step, "policy_digest": policy_digest, "dev": st.st_dev,
                       "ino": st.st_ino, "size": st.st_size, "mtime_ns": st.st_mtime_ns}).encode()


def write_stamp(path: str, step: int, policy_digest: str) -> None:
    """Record on the cache file ``path`` (an extended attribute: it stays with this inode, and
    setting it moves no mtime) that the file, as it is now, holds ``step`` (see "Trust"). Best
    effort: where extended attributes are unavailable the next publish hashes the cache first."""
    try:
        os.setxattr(path, STAMP_XATTR, _file_stamp(path, step, policy_digest))
    except (AttributeError, OSError) as e:  # no xattrs on this system or file system
        log.debug("cannot stamp the baseline cache (%s); the next delta hashes it first", e)
        drop_stamp(path)


def drop_stamp(path: str) -> None:
    """Forget the stamp of the cache file ``path`` (it failed a check)."""
    try:
        os.removexattr(path, STAMP_XATTR)
    except (AttributeError, OSError):
        pass


def _stamped(path: str, plan: PublishPlan) -> bool:
    """The stamp names the plan's base and still describes the cache file (see "Trust")."""
    try:
        return os.getxattr(path, STAMP_XATTR) == _file_stamp(path, plan.base_step, plan.base_policy_digest)
    except (AttributeError, OSError):
        return False


def _cache_matches(path: str, plan: PublishPlan, hash_tensors: bool) -> bool:
    """The cached baseline claims the base step (metadata, tensors' dtypes and shapes); with
    ``hash_tensors``, it also holds exactly its bits (every tensor hashed)."""
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
        if not hash_tensors:
            return True
        buf = np.empty(HASH_BUFFER_BYTES, dtype=np.uint8)  # one buffer, reused: no fresh tensor-sized memory
        return all(_hashes_to(ck, n, entries[n], buf) for n in entries)
    except (DCRError, OSError, ValueError):
        return False
    finally:
        ck.close()


def _hashes_to(ck: SafetensorsCheckpoint, name: str, entry, buf: np.ndarray) -> bool:
    """Tensor ``name`` of ``ck`` has ``entry``'s digest (read through ``buf``, piece by piece)."""
    if entry.pieces is not None:  # published from shards: a piecewise digest, over the whole tensor
        return entry.matches(ck.bits(name))
    storage = np.dtype(DTYPES[entry.dtype].storage)
    count, per = ck.infos[name].nbytes // storage.itemsize, len(buf) // storage.itemsize
    h = entry.scheme.hasher()
    for start in range(0, count, per):
        h.update(ck.read_into(name, start, buf[: min(per, count - start) * storage.itemsize].view(storage)))
    return h.hexdigest() == entry.digest


def _cache_valid(path: str, plan: PublishPlan) -> bool:
    """The cached baseline holds exactly the base step's bits (checked tensor by tensor)."""
    return _cache_matches(path, plan, hash_tensors=True)


def _cache_trusted(path: str, plan: PublishPlan) -> bool:
    """Usable without hashing it first: stamped, and its header claims the base (see "Trust")."""
    return _stamped(path, plan) and _cache_matches(path, plan, hash_tensors=False)


def load_baseline(plan: PublishPlan, held: LocalRef | None = None, recheck: bool = False) -> SourceRef | None:
    """The base step's bits: ``held`` if it is exactly the plan's base, else a local file (the
    cache if its stamp and header say it is the base, or if it verifies tensor by tensor, else
    rebuilt from ROOT into the cache, or into a private temp file without a cache). ``recheck``:
    the cache failed the check made while encoding; hash it in full (or rebuild it) whatever its
    stamp says."""
    if plan.kind == KEYFRAME:
        return None
    if held is not None:
        baseline = local_refs.get(held)
        if isinstance(baseline, HeldBaseline) and baseline.is_base_of(plan):
            return local_refs.put(baseline.source, "baseline")
    path = cache_path(plan)
    if plan.options.use_cache:
        _remove_stale_patch_logs(plan)
        if recheck:
            drop_stamp(path)
        if os.path.exists(path):
            if not recheck and _cache_trusted(path, plan):
                return path
            if _cache_valid(path, plan):
                write_stamp(path, plan.base_step, plan.base_policy_digest)
                return path
        drop_stamp(path)
    else:  # a private temp file, removed once the step is committed
        path = os.path.join(tempfile.gettempdir(), f"dcr-baseline-{plan.attempt}.safetensors")
    rebuild(plan, path)
    if plan.options.use_cache:
        write_stamp(path, plan.base_step, plan.base_policy_digest)
    return path


def rebuild(plan: PublishPlan, path: str, names=None) -> None:
    """Write the base step's bits (of tensors ``names`` only, if given: a group on a worker that
    cannot reach the publisher's cache) to ``path`` from ROOT, streamed through the shared reader
    (every chunk and every tensor verified)."""
    root = open_root(plan.root)
    rplan = reader.plan_refit(root, None, plan.base_step)
    ms = reader.manifests(rplan, root)
    target = ms[plan.base_step]
    infos = [target.tensors[n].info for n in sorted(target.tensors if names is None else names)]
    meta = state.metadata(plan.base_step, target.policy_digest, plan.root.url)
    writer = StreamingSafetensorsWriter(path, infos, meta, durable=False, header_room=state.HEADER_ROOM)
    try:
        for name, bits, _ in reader.refit_tensors(root, rplan, ms, None, plan.options.io_workers, names=names):
            writer.write(name, bits)
        writer.commit()
    except BaseException:
        writer.abort()
        raise


def remember_baseline(
    plan: PublishPlan, source: SourceRef, marker: CommitMarker, baseline: SourceRef | None = None, hold: bool = False,
) -> LocalRef | None:
    """Keep the committed policy as the next delta's baseline: with ``hold`` (``source`` is a
    snapshot this publish made), in memory (a ``HeldBaseline``, returned); else in the cache file,
    patched in place when this delta was encoded against it (see module doc), else copied whole.

    Runs after the commit: a failure here only costs the cache (the next publish rebuilds it)."""
    if isinstance(baseline, str) and not plan.options.use_cache and os.path.exists(baseline):
        os.unlink(baseline)  # the private temp baseline of a --no-cache publish
    if hold:  # the cache stays at its step; the next delta uses the held copy
        drop_patch_logs(plan)
        held = HeldBaseline(plan.root.url, marker.step, marker.policy_digest, open_source(source))
        events.reached("publish.baseline-kept", step=marker.step, where="memory")
        return local_refs.put(held, "held")
    if not plan.options.use_cache:
        return None
    meta = state.metadata(marker.step, marker.policy_digest, plan.root.url)
    logs = patch_logs(plan)
    try:
        if logs and baseline == cache_path(plan) and _patch_cache(plan, logs, marker, meta):
            return None
    finally:  # used or not (a group's log missing, a group that rebuilt its baseline): none is kept
        drop_patch_logs(plan)
    names = sorted(plan.infos)
    try:
        writer = StreamingSafetensorsWriter(cache_path(plan), [plan.infos[n] for n in names], meta, durable=False,
                                            header_room=state.HEADER_ROOM)
    except OSError as e:
        log.warning("cannot write the baseline cache (%s); the next delta rebuilds its baseline from ROOT", e)
        return None
    try:
        with opened(source) as raw:  # the cache holds what the step stores: a bundle as one tensor
            src = bundled.view(raw, plan.bundles)
            for n in names:  # one tensor at a time
                if isinstance(raw, safetensors.SafetensorsCheckpoint) and n in raw.infos:  # copied by the kernel
                    writer.copy_from(n, *raw.file_of(n))
                else:
                    writer.write(n, src.bits(n))
        writer.commit()
        # A checkpoint file may have changed since it was encoded: the stamp says only which file
        # this is, and the next delta checks its bits as it uses them (see "Trust").
        write_stamp(writer.path, marker.step, marker.policy_digest)
        events.reached("publish.baseline-kept", step=marker.step, where=writer.path)
        bound_cache(plan)
    except (OSError, DCRError, ValueError) as e:  # the step is committed; only the cache is lost
        writer.abort()
        log.warning("cannot write the baseline cache (%s); the next delta rebuilds its baseline from ROOT", e)
    return None


def _patch_cache(plan: PublishPlan, logs: list[str], marker: CommitMarker, meta: dict[str, str]) -> bool:
    """Patch the cache file (the base step, as the delta just committed was encoded against it)
    into the committed step with the encode pass's log (or its groups' logs, in turn); False (the
    cache then gets copied whole) when a log is not this attempt's or does not apply."""
    path = cache_path(plan)
    try:
        if len(logs) == 1:
            if patch_log.read_head(logs[0]) != patch_log_head(plan):
                return False
        elif [patch_log.read_head(p) for p in logs] != [patch_log_head(plan, g, len(logs)) for g in range(len(logs))]:
            return False
        f = open(path, "r+b")
    except (OSError, DCRError):
        return False
    with f:
        try:  # no other publisher reads (shared lock, while encoding) or patches this file now
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return False  # busy: the copy replaces it by a rename, which its readers never see
        # Still the base the log was computed against: the same file, stamped with the base step
        # (another publisher of this ROOT may have patched or replaced it since).
        if os.fstat(f.fileno()).st_ino != os.stat(path).st_ino or not _cache_trusted(path, plan):
            return False
        drop_stamp(path)  # from here until the new stamp, the cache is hashed in full before any use
        try:
            written = 0
            for log_path in logs:  # the groups' logs touch disjoint tensors: any order gives the same file
                written += patch_log.apply(log_path, path, meta, progress=lambda i: events.reached(
                    "publish.baseline-patched-record", index=i))
        except (OSError, DCRError, ValueError) as e:
            log.warning("cannot patch the baseline cache in place (%s); copying the checkpoint into it", e)
            return False
        write_stamp(path, marker.step, marker.policy_digest)
    events.reached("publish.baseline-kept", step=marker.step, where=path, patched=written)
    bound_cache(plan)
    return True


def bound_cache(plan: PublishPlan) -> None:
    """Keep the cache within ``DCR_CACHE_MAX_BYTES`` (``storage.local.cache``), this ROOT's baseline
    kept. Only the cache is at stake (a pruned entry costs a rebuild): a failure is logged."""
    try:
        report = cache.prune(plan.options.cache_dir, keep=cache_path(plan))
    except (OSError, DCRError) as e:
        log.warning("cannot keep the cache in %s within its bound (%s)", plan.options.cache_dir, e)
        return
    for r in report.removed:
        log.info("cache: removed %s (%d bytes): %s", r["path"], r["nbytes"], r["why"])


def share_cache(src: Source) -> None:
    """Hold a shared lock on the cache file ``src`` reads (until it is closed): no publisher patches
    it in place meanwhile (``_patch_cache`` takes the lock exclusively, or copies instead)."""
    if isinstance(src, safetensors.SafetensorsCheckpoint) and src.infos:
        try:
            fcntl.flock(src.file_of(next(iter(src.infos)))[0], fcntl.LOCK_SH)
        except OSError as e:  # no flock here (some network filesystems): a patch under this reader
            # changes bits it hashes, so the encoding fails its base check and is redone from ROOT
            log.debug("cannot share-lock the baseline cache (%s)", e)
