"""``dcr mirror SRC DST``: copy committed steps from an upstream ROOT to a downstream ROOT.

A mirror is a ROOT like any other: receivers refit from it exactly as from the origin, and a
mirror of a mirror makes a tree. For each step it copies (every step committed upstream and not
yet downstream, ascending; or ``--step N``):

1. the upstream commit marker is read once and checked (its signature, with ``DCR_VERIFY_KEY_FILE``
   or a signing key configured; its run), and the manifest it names (against the marker's digest);
2. ``run.json`` is copied if the downstream ROOT has none (the same run); a downstream ROOT of
   another run is refused;
3. every object of the committed attempt (manifest, source layout, Zarr metadata, chunks, snapshots, rank parts)
   is copied, byte for byte, unless downstream already holds it with the same size: only the
   attempt the marker names, never a losing or uncommitted one; ``io_workers`` objects at a time
   (an inter-region link is latency-bound one request at a time). Each object the manifest binds
   is read no further than the size the manifest gives it, and checked as it is read (size and
   payload digest; the manifest by the marker's digest), before it is written downstream: a step
   that does not verify upstream fails naming the object (a 3 GB object where a chunk or pack
   belongs, having read at most its size), and its marker is never copied (``expected_objects``);
4. the marker is written last: the bytes checked in 1, never a second read (upstream may have
   been edited since; what was copied is what those bytes bind), so its signature is the origin's.
   It is created only if absent; a downstream marker that verifies but names another attempt is
   refused, and one that does not verify (damaged, or copied before this rule) is replaced.

Every document a mirror writes downstream is the bytes it verified, and a downstream document that
does not verify is treated as absent (docs/guides/mirrors-signing.md: what a mirror does when
upstream edits a step it is copying).

Before it copies anything, a mirror copies upstream's retraction records (``dcr retract``) of the
steps it holds (``sync_retractions``): its receivers move back as the origin's do; after, upstream's
heartbeat (``sync_heartbeat``).

With ``as_id`` (``dcr mirror --as ID``) the mirror is also a receiver of SRC: it leases each step
while copying it and records its position in SRC, so gc there keeps what the mirror still needs
(as for any registered receiver). Without ``--step``, a mirror that already holds steps copies
only the upstream steps newer than its newest (and checks those it holds): an older step it lacks
was deleted by gc there (or skipped with ``--step``), and copying it back would cost the link a
copy that the next gc deletes again. A crash anywhere before 4 leaves the step invisible
downstream (no marker); a rerun copies what is missing and commits. Receivers verify everything
they pull from a mirror against the origin's signature and digests, as from the origin.
``mirror_refit`` is the Prefect flow (``plan-mirror``, one ``copy-step`` task per step; the
``mirror`` deployment of ``infra/prefect.yaml``); with workers (``flows.workers``) a step's objects
are copied by ``copy-object-batch`` tasks mapped over runs of them, and the marker by the flow. Forwarding an attempt while it is written
upstream (``dcr mirror --follow --stream``) is ``flows.maintenance.mirror_stream``.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from dcr_core import events
from dcr_core.batches import batches_for
from dcr_core.errors import DCRError, IntegrityError, StepConflictError, UsageError
from flows.steps import InProcess, Runner, Step, StepTable
from flows.workers import portable_root
from storage import heartbeat, layout, leases, source_layout
from storage.catalog import Catalog, manifest_digest, not_committed
from storage.chunk_io import IO_WORKERS, BoundedPool, UncheckedChunk, chunk_where
from storage.manifest import MAX_MANIFEST_BYTES, Manifest, TensorEntry
from storage.marker import CommitMarker
from storage.root import Root, RootRef, open_root
from storage.stream import MAX_INDEX_BYTES, index_at

log = logging.getLogger("dcr.mirror")
LEASE_SECONDS = 3600.0
# What honest stream indexes can hold (``index_budget``), per chunk besides its names, and in all:
# an index entry (digest, size, position) with its array's dtype and shapes and the index's own fields.
INDEX_BYTES_PER_CHUNK = 1024
INDEX_SLACK_BYTES = 64 << 10


@dataclass
class MirrorResult:
    copied_steps: list[int] = field(default_factory=list)
    present_steps: list[int] = field(default_factory=list)  # already committed downstream
    objects_copied: int = 0
    bytes_copied: int = 0
    retracted_steps: list[int] = field(default_factory=list)  # upstream's retractions copied downstream


def _copy_run(src: Root, dst: Root) -> None:
    data = src.read(layout.RUN) if src.exists(layout.RUN) else None
    if data is None:
        return  # a ROOT from before runs: its markers name none
    if dst.create_if_absent(layout.RUN, data):
        return
    held = dst.read(layout.RUN)
    if held != data:
        raise StepConflictError(f"{dst.url}/{layout.RUN}: another run than {src.url}'s; a mirror holds one run "
                                "(give it an empty ROOT)")


@dataclass(frozen=True)
class MirrorJob:
    """A committed step of SRC to copy to DST: its attempt and manifest digest, the bytes of SRC's
    marker that were verified (exactly what DST gets), and the objects of the attempt DST lacks
    (keys and sizes)."""

    step: int
    attempt: str
    manifest_digest: str
    marker: bytes
    todo: tuple[tuple[str, int], ...] = ()


def mirror_step(src: Root, dst: Root, step: int, result: MirrorResult, as_id: str | None = None,
                io_workers: int = IO_WORKERS) -> None:
    """Copy committed step ``step`` of ``src`` to ``dst`` (see the module docstring); a step already
    committed downstream is only checked (same attempt). ``as_id``: the mirror is also a receiver
    of ``src`` by that id and leases the step while copying it."""
    job = open_step(src, dst, step, result, as_id, io_workers)
    if job is None:
        return
    try:
        objects, nbytes = copy_objects(src, dst, [k for k, _ in job.todo], io_workers, expected_objects(src, job))
        result.objects_copied += objects
        result.bytes_copied += nbytes
        commit_step(dst, job, result)
    finally:
        close_step(src, job, as_id)


def open_step(src: Root, dst: Root, step: int, result: MirrorResult, as_id: str | None = None,
              io_workers: int = IO_WORKERS) -> MirrorJob | None:
    """Check upstream's marker, lease the step for ``as_id``, check the manifest, copy ``run.json``
    if needed and list what to copy (objects already downstream read back ``io_workers`` at a
    time: ``unvouched_copies``); None (and the step noted present) when DST already committed
    the same attempt. A marker DST holds that does not verify is no commit: the step is copied
    again and its marker replaced (``commit_step``). Whoever gets a job releases it (``close_step``)."""
    scat = Catalog(src)
    found = scat.read_marker(step)
    if found is None:
        raise not_committed(src, f"step {step} is not committed")
    marker, raw = found
    present = held_marker(Catalog(dst), step)
    if present is not None:
        if present.attempt != marker.attempt or present.manifest_digest != marker.manifest_digest:
            raise StepConflictError(f"{dst.url}: step {step} holds attempt {present.attempt}, upstream committed "
                                    f"{marker.attempt}; a mirror never replaces a committed step")
        result.present_steps.append(step)
        return None
    if as_id is not None:
        leases.take(src, as_id, [step], step, LEASE_SECONDS)
    try:
        scat.manifest(step)  # read and checked against the marker just verified (scat holds it)
        _copy_run(src, dst)
        job = MirrorJob(step, marker.attempt, marker.manifest_digest, raw)
        prefix = layout.attempt_dir(step, marker.attempt)
        have = {o.key: o.size for o in dst.objects(prefix)}
        upstream = src.objects(prefix)
        present = [o.key for o in upstream if have.get(o.key) == o.size]
        again = set(unvouched_copies(src, dst, job, present, io_workers))
        todo = tuple((o.key, o.size) for o in upstream if have.get(o.key) != o.size or o.key in again)
    except BaseException:
        if as_id is not None:
            leases.release(src, as_id, [step])
        raise
    return dataclasses.replace(job, todo=todo)


def held_marker(dcat: Catalog, step: int) -> CommitMarker | None:
    """DST's marker of ``step``, or None: none there, or one that does not verify (under the key,
    when the mirror has one; malformed, or of another run). Such a marker commits nothing a receiver
    accepts, so the mirror treats it as absent and replaces it with upstream's verified bytes: a
    damaged copy never wedges the mirror or its receivers."""
    try:
        return dcat.marker(step)
    except IntegrityError:
        return None


def held_steps(dcat: Catalog) -> set[int]:
    """The steps DST shows live, and those whose marker or retraction record does not verify
    (``held_marker``: the mirror repairs them)."""
    held = set()
    for step in dcat.listed_steps():
        try:
            if dcat.is_live(step):
                held.add(step)
        except IntegrityError:
            held.add(step)
    return held


def close_step(src: Root, job: MirrorJob, as_id: str | None = None) -> None:
    """Release the lease ``open_step`` took for ``as_id`` (copied or not)."""
    if as_id is not None:
        leases.release(src, as_id, [job.step])


@dataclass(frozen=True)
class Expected:
    """An object the manifest binds: read at most ``limit`` bytes of it (a larger object is refused
    unread: the size the manifest gives, or a document's cap), and ``check`` its bytes."""

    limit: int
    check: Callable[[bytes], None]


def expected_objects(src: Root, job: MirrorJob) -> dict[str, Expected]:
    """For each object of the job's attempt that its manifest binds (the manifest itself, by the
    digest of the marker the job verified, never one read again; every chunk, snapshot and part, by
    its size and payload digest; a pack as its chunks), the most bytes to read of it and a check of
    its bytes that raises ``IntegrityError`` naming the object. A mirror runs it on every object it
    reads, and writes downstream the very bytes it checked: a damaged object upstream is never
    copied onward, and one larger than the manifest says is refused having read at most its size.
    (The Zarr metadata documents of the store are not bound by a digest: receivers never read them.)"""
    m = Catalog(src).manifest_at(job.step, job.attempt, job.manifest_digest)
    manifest_key = layout.manifest_key(job.step, job.attempt)
    checks: dict[str, Expected] = {}

    def manifest_check(data: bytes) -> None:
        if manifest_digest(data) != job.manifest_digest:
            raise IntegrityError(f"{src.url}/{manifest_key}: manifest digest does not match its commit marker")

    checks[manifest_key] = Expected(MAX_MANIFEST_BYTES, manifest_check)
    if m.source is not None:  # the published file's headers (storage.source_layout), bound by digest too
        source_key = layout.source_key(m.step, m.attempt)

        def source_check(data: bytes) -> None:
            if len(data) != m.source.nbytes or source_layout.digest(data) != m.source.digest:
                raise IntegrityError(f"{src.url}/{source_key}: source layout does not match the digest its manifest gives")

        checks[source_key] = Expected(m.source.nbytes, source_check)
    packs: dict[str, list[tuple[int, TensorEntry, int]]] = {}  # key -> (offset, entry, position)
    for entries in (m.tensors, m.snapshot or {}):
        for e in entries.values():
            for pos in range(e.n_stored):
                rel, index, digest, nbytes = e.stored_at(pos)
                key = layout.store_key(m.step, m.attempt, rel)
                offset = e.offset_at(pos)
                if offset is not None:
                    packs.setdefault(key, []).append((offset, e, pos))
                    continue

                def chunk_check(data: bytes, key=key, e=e, index=index, digest=digest, nbytes=nbytes) -> None:
                    if len(data) != nbytes:
                        raise IntegrityError(f"{src.url}/{key}: chunk is {len(data)} bytes, the manifest says {nbytes}")
                    UncheckedChunk(src.url, key, data, m.codec, e.dtype, e.grid, index, digest).checked()

                checks[key] = Expected(nbytes, chunk_check)
    for key, held in packs.items():
        held.sort(key=lambda h: h[0])
        size = sum(e.stored_nbytes[pos] for _, e, pos in held)
        checks[key] = Expected(size, functools.partial(_check_pack, src.url, key, m, held, size))
    return checks


def _check_pack(url: str, key: str, m: Manifest, held: list[tuple[int, TensorEntry, int]], size: int,
                data: bytes) -> None:
    """A pack's bytes are exactly its chunks (the manifest's offsets tile it), each decoding to its digest."""
    if len(data) != size:
        raise IntegrityError(f"{url}/{key}: pack is {len(data)} bytes, the manifest says {size}")
    for offset, e, pos in held:
        _, index, digest, nbytes = e.stored_at(pos)
        where = chunk_where(key, offset, nbytes)
        UncheckedChunk(url, where, data[offset:offset + nbytes], m.codec, e.dtype, e.grid, index, digest).checked()


def unvouched_copies(src: Root, dst: Root, job: MirrorJob, keys: list[str], io_workers: int = IO_WORKERS) -> list[str]:
    """Of the objects already downstream (``keys``: a copy cut off earlier, or chunks and packs a
    streaming mirror forwarded before the commit), those to copy again: each that the manifest
    binds is read back and checked (``io_workers`` at a time: a forwarded step's packs are all
    downstream), unless it is a chunk object a downstream stream index lists with the digest the
    manifest gives (the ``Forwarder`` checked its bytes against that digest before writing them).
    So a chunk that matched only a forged stream index is replaced, never committed onward, and a
    pack is always read back: the digests an index would name are public in the manifest."""
    checks = expected_objects(src, job)
    m = Catalog(src).manifest_at(job.step, job.attempt, job.manifest_digest)
    bound = chunk_digests(m)
    vouched = vouched_chunks(dst, job, {k: bound[k] for k in keys if k in bound}, index_budget(m))

    def bad(key: str) -> bool:
        try:
            checks[key].check(dst.read(key, limit=checks[key].limit))
        except (IntegrityError, FileNotFoundError):
            return True
        return False

    unvouched = [k for k in keys if k in checks and k not in vouched]
    with BoundedPool(io_workers, name="dcr-mirror-check") as pool:
        futures = [pool.submit(bad, key) for key in unvouched]
        return [key for key, f in zip(unvouched, futures) if f.result()]


def vouched_chunks(dst: Root, job: MirrorJob, wanted: dict[str, str], budget: int) -> set[str]:
    """The keys of ``wanted`` (key: the digest the manifest gives) that DST's stream indexes of the
    job's attempt list with that digest. The indexes are read in order, one at a time (only what
    they say of ``wanted`` is kept), until the first missing or damaged one, and only while they
    total at most ``budget`` bytes: an index past it is not read (one warning), and the chunks it
    might vouch for are read back and checked instead, so forged indexes cost at most the budget."""
    vouched: set[str] = set()
    if not wanted:
        return vouched  # no chunk downstream to vouch for: no index read
    left = budget
    for seq in range(1 << 20):
        key = layout.stream_key(job.step, job.attempt, seq)
        try:
            data = dst.read(key, limit=min(MAX_INDEX_BYTES, left))
            idx = index_at(data, f"{dst.url}/{key}", job.step, job.attempt, seq)
        except FileNotFoundError:
            break
        except (DCRError, OSError) as e:  # a damaged index vouches for nothing after it
            log.warning("%s (stream indexes of step %d may hold %d bytes in all); the chunks it would vouch for are "
                        "read back and checked instead", str(e).splitlines()[0], job.step, budget)
            break
        left -= len(data)
        for c in idx.chunks:
            chunk = layout.store_key(job.step, job.attempt, c.key_in_store)
            if wanted.get(chunk) == c.digest:
                vouched.add(chunk)
    return vouched


def index_budget(m: Manifest) -> int:
    """The most bytes the stream indexes of ``m``'s attempt hold when they are honest: each lists
    every stored chunk once, and at worst (one chunk per index, a slow upload) repeats with it its
    tensor's and array's names, shapes and the index's own fields (``INDEX_BYTES_PER_CHUNK``)."""
    return INDEX_SLACK_BYTES + sum(e.n_stored * (INDEX_BYTES_PER_CHUNK + len(name) + len(e.array))
                                   for entries in (m.tensors, m.snapshot or {}) for name, e in entries.items())


def chunk_digests(m: Manifest) -> dict[str, str]:
    """The payload digest the manifest gives each stored chunk, by key."""
    out = {}
    for entries in (m.tensors, m.snapshot or {}):
        for e in entries.values():
            for pos in range(e.n_stored):
                rel, _, digest, _ = e.stored_at(pos)
                if e.offset_at(pos) is None:  # a pack is read back and checked whole (no stream index vouches for it)
                    out[layout.store_key(m.step, m.attempt, rel)] = digest
    return out


def copy_objects(src: Root, dst: Root, keys: list[str], io_workers: int = IO_WORKERS,
                 checks: dict[str, Expected] | None = None) -> tuple[int, int]:
    """Copy ``keys`` byte for byte, ``io_workers`` at a time: (objects, bytes) copied. ``checks``
    (``expected_objects``): each object is read no further than its limit and checked as read,
    before it is written downstream."""

    def copy(key: str) -> int:
        expected = (checks or {}).get(key)
        data = src.read(key, limit=None if expected is None else expected.limit)
        if expected is not None:
            expected.check(data)
        dst.write(key, data)
        events.reached("mirror.object-copied", key=key, nbytes=len(data))
        return len(data)

    with BoundedPool(io_workers, name="dcr-mirror") as pool:
        futures = [pool.submit(copy, key) for key in keys]
        sizes = [f.result() for f in futures]  # every object is there before the marker is written
    return len(sizes), sum(sizes)


def commit_step(dst: Root, job: MirrorJob, result: MirrorResult) -> None:
    """Write the marker last: the bytes of upstream's marker that ``open_step`` verified, never a
    second read (upstream may have changed it since; what was copied is what that marker binds).
    A marker DST holds that does not verify is replaced (``held_marker``)."""
    step = job.step
    events.reached("mirror.payload-copied", step=step)
    if not dst.create_if_absent(layout.commit_key(step), job.marker):
        held = held_marker(Catalog(dst), step)
        if held is None:
            log.warning("%s/%s did not verify: replaced by upstream's", dst.url, layout.commit_key(step))
            dst.write(layout.commit_key(step), job.marker)
        elif held.attempt != job.attempt:
            raise StepConflictError(f"{dst.url}: step {step} was committed by someone else while it was mirrored")
    events.reached("mirror.committed", step=step)
    result.copied_steps.append(step)


def plan_mirror(src: RootRef, step: int | None, dst: RootRef | None = None) -> list[int]:
    """The steps to mirror: ``step``, or every step committed upstream (ascending); with ``dst``,
    of those only the ones ``dst`` holds (checked) and the ones newer than its newest. Only those
    steps' markers are read upstream (not the older history gc deleted downstream)."""
    if step is not None:
        return [layout.check_step(step)]
    s = open_root(src)
    scat = Catalog(s)
    listed = scat.listed_steps()
    if dst is not None:
        held = held_steps(Catalog(open_root(dst)))
        if held:
            listed = [st for st in listed if st in held or st > max(held)]
    steps = [st for st in listed if scat.is_live(st)]
    if not steps and scat.latest_committed() is None:
        raise not_committed(s, "no committed step to mirror")
    return steps


def sync_retractions(src: RootRef, dst: RootRef) -> list[int]:
    """Copy upstream's retraction records (``dcr retract``) of the steps ``dst`` holds, byte for byte
    (their signatures are the publisher's): the very bytes checked upstream (the record binds the
    step's attempt, and its signature verifies), never a second read. Every step ``dst`` holds is
    looked at (a retracted step may be older than upstream's newest: publishing went on after the
    retraction), and only those: the cost is two small reads upstream per step the mirror holds,
    whatever upstream's history. A record downstream that does not verify is no retraction: it is
    replaced by upstream's, or removed where upstream has none. The steps it marked retracted downstream."""
    s, d = open_root(src), open_root(dst)
    scat, dcat = Catalog(s), Catalog(d)
    marked = []
    for step in dcat.listed_steps():
        held = held_marker(dcat, step)
        if held is None:
            continue  # none (or one that does not verify: mirror_step copies the step again)
        key = layout.retraction_key(step)
        try:
            if dcat.retraction(step) is not None:
                continue
            damaged = False
        except IntegrityError as e:
            log.warning("%s; replaced by upstream's record, or removed", str(e).splitlines()[0])
            damaged = True
        found = scat.read_retraction(step)
        if found is None:
            if damaged:
                d.remove(key)
            continue
        retraction, raw = found
        if (held.attempt, held.manifest_digest) != (retraction.attempt, retraction.manifest_digest):
            raise StepConflictError(f"{d.url}: step {step} holds attempt {held.attempt}; upstream retracted "
                                    f"{retraction.attempt}")
        if damaged:
            d.write(key, raw)
        else:
            d.create_if_absent(key, raw)
        marked.append(step)
    return marked


def sync_heartbeat(src: RootRef, dst: RootRef) -> bool:
    """Make ``dst``'s heartbeat (``storage.heartbeat``) upstream's, byte for byte: the very bytes
    checked upstream (with the mirror's key, if any), never a second read. Whatever else ``dst``
    holds there (older, or planted: unsigned, dated ahead) is replaced, so a mirror that keeps
    copying keeps its receivers' ``--max-staleness`` satisfied, and one that stops does not.
    Not copied when it names a step ``dst`` does not hold (``heartbeat.vouches_for``). Whether it wrote."""
    s, d = open_root(src), open_root(dst)
    try:
        raw = s.read(heartbeat.KEY, limit=heartbeat.MAX_HEARTBEAT_BYTES)
    except FileNotFoundError:
        return False
    up = heartbeat.verified(raw, f"{s.url}/{heartbeat.KEY}", Catalog(s).key)
    try:
        if d.read(heartbeat.KEY, limit=heartbeat.MAX_HEARTBEAT_BYTES) == raw:
            return False
    except (FileNotFoundError, IntegrityError):
        pass  # none, or larger than a heartbeat may be: written
    try:
        heartbeat.vouches_for(d, up)  # only for what the mirror holds (not when it mirrors an older --step)
    except heartbeat.StaleRootError:
        return False
    d.write(heartbeat.KEY, raw)
    return True


def record_position(src: RootRef, dst: RootRef, as_id: str, step: int) -> bool:
    """Record in ``src`` that mirror ``as_id`` holds ``step`` (its position: gc there keeps what it
    needs from then on); nothing is written when the position already says so. True if written."""
    cat = Catalog(open_root(src))
    position = cat.position(as_id)
    if position is not None and position.get("step") == step:
        return False
    marker = Catalog(open_root(dst)).require_marker(step)
    cat.record_receiver(step, as_id, {"mirror": dst.url, "policy_digest": marker.policy_digest})
    return True


def copy_step(src: RootRef, dst: RootRef, step: int, as_id: str | None = None, io_workers: int = IO_WORKERS) -> dict:
    """One step (a task): copied, or found already there (checked: the same attempt)."""
    result = MirrorResult()
    mirror_step(open_root(src), open_root(dst), step, result, as_id, io_workers)
    return asdict(result)


def open_mirror_step(src: RootRef, dst: RootRef, step: int, as_id: str | None = None) -> MirrorJob | None:
    """``open_step`` as a task (on workers: the flow maps ``copy_object_batch`` over its objects)."""
    return open_step(open_root(src), open_root(dst), step, MirrorResult(), as_id)


def copy_object_batch(src: RootRef, dst: RootRef, keys: tuple[str, ...], job: MirrorJob, io_workers: int = IO_WORKERS) -> dict:
    """A mapped task: copy ``keys`` (objects of the job's step, each checked against the manifest
    its verified marker binds as it is read) where it runs; what it copied."""
    s = open_root(src)
    objects, nbytes = copy_objects(s, open_root(dst), list(keys), io_workers, expected_objects(s, job))
    return {"objects": objects, "bytes": nbytes}


def commit_mirrored_step(dst: RootRef, job: MirrorJob) -> None:
    commit_step(open_root(dst), job, MirrorResult())


def release_mirror_lease(src: RootRef, job: MirrorJob, as_id: str | None) -> None:
    close_step(open_root(src), job, as_id)


class MirrorSteps(StepTable):
    sync_retractions = Step(sync_retractions)
    plan_mirror = Step(plan_mirror)
    copy_step = Step(copy_step)
    # on workers: open the step, copy its objects in batches (mapped), commit it, release its lease
    open_mirror_step = Step(open_mirror_step)
    copy_object_batch = Step(copy_object_batch)
    commit_mirrored_step = Step(commit_mirrored_step)
    release_mirror_lease = Step(release_mirror_lease)
    record_position = Step(record_position)
    sync_heartbeat = Step(sync_heartbeat)


def run_mirror(src: str, dst: str, step: int | None = None, src_options: dict | None = None,
               dst_options: dict | None = None, runner: Runner | None = None, as_id: str | None = None,
               io_workers: int = IO_WORKERS, group_bytes: int | None = None) -> MirrorResult:
    """Copy ``step`` (default: every committed step upstream that is newer than the newest ``dst``
    holds; those downstream already has are checked, not copied) from ROOT ``src`` to ``dst``, each
    with its own storage options, ``io_workers`` objects at a time. ``as_id``: register the mirror
    upstream as a receiver (see ``mirror_step``). With a runner that maps (``flows.workers``), each
    step's objects are copied by tasks mapped over batches of about ``group_bytes`` (default:
    ``dcr_core.batches.target_bytes``) on its workers; the marker is still copied last, here."""
    if as_id is not None:
        layout.check_receiver(as_id)
    if group_bytes is not None and group_bytes < 1:
        raise UsageError(f"group_bytes must be at least 1, got {group_bytes}")
    s, d = RootRef(src, dict(src_options or {})), RootRef(dst, dict(dst_options or {}))
    tasks = MirrorSteps(runner or InProcess())
    if tasks.mapped:
        s, d = portable_root(s), portable_root(d)
    result = MirrorResult()
    if io_workers < 1:
        raise UsageError(f"io_workers must be at least 1, got {io_workers}")
    result.retracted_steps = tasks.sync_retractions(s, d)  # first: downstream never shows a retracted step live
    for st in tasks.plan_mirror(s, step, d):
        if tasks.mapped:
            _mirror_mapped(tasks, s, d, st, as_id, io_workers, group_bytes, result)
            continue
        one = tasks.copy_step(s, d, st, as_id, io_workers)
        result.copied_steps += one["copied_steps"]
        result.present_steps += one["present_steps"]
        result.objects_copied += one["objects_copied"]
        result.bytes_copied += one["bytes_copied"]
    if as_id is not None:
        tasks.record_position(s, d, as_id, max(result.copied_steps + result.present_steps))
    tasks.sync_heartbeat(s, d)  # last: it vouches for what the mirror now holds
    return result


def _mirror_mapped(tasks: MirrorSteps, s: RootRef, d: RootRef, step: int, as_id: str | None, io_workers: int,
                   group_bytes: int | None, result: MirrorResult) -> None:
    job = tasks.open_mirror_step(s, d, step, as_id)
    if job is None:
        result.present_steps.append(step)
        return
    try:
        batches = [{"keys": tuple(b)} for b in batches_for(job.todo, tasks.slots, group_bytes)]
        marker_only = dataclasses.replace(job, todo=())  # what each task needs of the job: not the others' keys
        for part in tasks.map(copy_object_batch, batches, src=s, dst=d, job=marker_only, io_workers=io_workers):
            result.objects_copied += part["objects"]
            result.bytes_copied += part["bytes"]
        tasks.commit_mirrored_step(d, job)
        result.copied_steps.append(step)
    finally:
        tasks.release_mirror_lease(s, job, as_id)
