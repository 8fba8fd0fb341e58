"""Planning a publish: everything checked before the first write, for canonical and sharded sources.

A plan fixes the step, its kind (keyframe or delta), its base (pinned by manifest digest), a fresh
attempt id and the tensors published; a rank of a sharded publish plans the same way for the
tensors it touches (``rank``/``world``), and rank 0 later checks that every rank planned alike.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import uuid
from dataclasses import dataclass

from dcr_core import bundles, events
from dcr_core.bundles import Members
from dcr_core.chain import DELTA, KEYFRAME
from dcr_core.chunking import choose_chunk_shape
from dcr_core.digest import DigestScheme, scheme_of
from dcr_core.dtypes import DTYPES, TensorInfo
from dcr_core.errors import InvalidCheckpointError, SchemaMismatchError, StepConflictError, UsageError
from flows.options import PublishOptions
from flows.publish.sources import SourceRef, opened
from storage import layout, source_layout
from storage.backends import registry
from storage.catalog import Catalog
from storage.document_fields import MAX_DIM, MAX_NDIM
from storage.local.safetensors import SafetensorsCheckpoint
from storage.manifest import MAX_TENSORS, Manifest, TensorEntry, refusal
from storage.reader import StepRef
from storage.root import Root, RootRef, open_root

log = logging.getLogger("dcr.publish")

DEFAULT_TIMEOUT = 600.0  # seconds the ranks of a sharded publish wait for each other (and for the commit)


@dataclass(frozen=True)
class PublishPlan:
    root: RootRef
    step: int
    kind: str
    base: StepRef | None  # the base step of a delta, its manifest pinned by digest
    base_policy_digest: str | None
    attempt: str
    infos: dict[str, TensorInfo]  # what is published (a rank: the canonical tensors it touches)
    options: PublishOptions
    source_name: str = ""
    keyframe_reason: str = ""  # why the step is a keyframe or carries a snapshot ("" otherwise)
    snapshot: bool = False  # a delta that also stores a full copy of its step (keyframe policy)
    rank: int = 0
    world: int = 1
    # A safetensors file or directory published as it is: its path, and the digest of its layout
    # (``storage.source_layout``) as planned; the manifest keeps the layout if it is still the same.
    source_file: str | None = None
    source_layout: str = ""  # the layout's digest, or why the files cannot be rebuilt byte for byte
    # Small tensors stored as bundles (``dcr_core.bundles``; ``infos`` then names the bundles, not
    # their members): chosen by a keyframe, kept from the base by a delta.
    bundles: dict[str, Members] = dataclasses.field(default_factory=dict)

    @property
    def base_step(self) -> int | None:
        return None if self.base is None else self.base.step

    @property
    def codec(self):
        return self.options.keyframe_codec if self.kind == KEYFRAME else self.options.delta_codec

    @property
    def scheme(self) -> DigestScheme:
        """The digest scheme of the step's manifest."""
        return scheme_of(self.options.digest_block_bytes)

    def base_entries(self) -> dict[str, TensorEntry]:
        """The base step's entries (empty for a keyframe), from its pinned manifest."""
        return {} if self.base is None else base_manifest(self).tensors


def base_manifest(plan: PublishPlan) -> Manifest:
    ref = plan.base
    return Catalog(open_root(plan.root)).manifest_at(ref.step, ref.attempt, ref.manifest_digest)


def _schema_diff(base: Manifest, infos: dict[str, TensorInfo], whole: bool) -> str | None:
    """What differs between the tensors published and the base step's (``whole``: the same set)."""
    held = {n: (dtype, shape) for n, dtype, shape, _ in base.policy_entries()}  # shapes are tuples
    if (not whole or len(held) == len(infos)) and all(held.get(n) == (i.dtype, i.shape) for n, i in infos.items()):
        return None  # the common case, in one pass
    missing = sorted(set(held) - set(infos)) if whole else []
    extra = sorted(set(infos) - set(held))
    more = lambda xs: f" (and {len(xs) - 1} more)" if len(xs) > 1 else ""
    if missing:
        return f"tensor {missing[0]!r} of step {base.step} is missing{more(missing)}"
    if extra:
        return f"tensor {extra[0]!r} is not in step {base.step}{more(extra)}"
    for name in sorted(infos):
        e, i = held[name], infos[name]
        if e != (i.dtype, i.shape):
            return f"tensor {name!r} is {i.dtype}{list(i.shape)}, step {base.step} has {e[0]}{list(e[1])}"
    return None


def check_receivable(infos: dict[str, TensorInfo], options: PublishOptions, source_name: str) -> None:
    """Every tensor is one receivers can read (their manifest limits): refused before any write."""
    if len(infos) > MAX_TENSORS:
        raise InvalidCheckpointError(f"{source_name or 'checkpoint'}: {len(infos)} tensors, more than the {MAX_TENSORS} a step may hold")
    small = options.chunk_bytes
    sizes = {k: d.itemsize for k, d in DTYPES.items()}
    refused: dict[tuple[str, tuple[int, ...]], str] = {}
    for dtype, shape in {(i.dtype, tuple(i.shape)) for i in infos.values()}:  # a model has few distinct ones
        if len(shape) <= MAX_NDIM and 0 < math.prod(shape) * sizes[dtype] <= small \
                and (not shape or max(shape) <= MAX_DIM):
            continue  # one chunk at most, within every limit: nothing to refuse
        chunk = choose_chunk_shape(shape, DTYPES[dtype].itemsize, options.chunk_bytes,
                                   options.column_blocks) if len(shape) <= MAX_NDIM else ()
        why = refusal(shape, dtype, chunk)
        if why:
            refused[dtype, shape] = why
    if refused:  # the first such tensor by name
        name = min(n for n, i in infos.items() if (i.dtype, tuple(i.shape)) in refused)
        i = infos[name]
        raise InvalidCheckpointError(f"{source_name or 'checkpoint'}: tensor {name!r} {i.dtype}{list(i.shape)}: "
                                     f"{refused[i.dtype, tuple(i.shape)]}; receivers could not read it")


def check_free(root: Root, cat: Catalog, step: int) -> int | None:
    """Step ``step`` can still be published on ``root``; returns the latest committed step."""
    layout.check_step(step)
    if not root.backend.supports_conditional_create:
        raise UsageError(f"{root.url}: no atomic create-if-absent for {root.protocol!r} ROOTs; "
                         f"use {registry.forms(publishable=True)}")
    latest = cat.latest_committed()  # the newest live step: retracted ones are skipped
    if cat.marker(step) is not None or cat.retraction(step) is not None:
        if cat.retraction(step) is not None:
            raise StepConflictError(f"{root.url}: step {step} was committed and retracted; a step number is never used "
                                    f"twice: publish step {next_free(cat, latest)} or another never committed")
        raise StepConflictError(f"{root.url}: step {step} is already committed")
    if latest is not None and step <= latest:
        raise StepConflictError(
            f"{root.url}: step {step} is not after the latest committed step {latest}; publish step "
            f"{next_free(cat, latest)} or later"
        )
    return latest


def next_free(cat: Catalog, latest: int | None) -> int:
    """The lowest step number above the newest live step that was never committed."""
    used = set(cat.used_steps())
    n = 0 if latest is None else latest + 1
    while n in used:
        n += 1
    return n


def plan_publish(
    root: RootRef, infos: dict[str, TensorInfo], step: int, keyframe: bool, options: PublishOptions,
    source_name: str = "", shard: tuple[int, int] | None = None, attempt: str | None = None,
    order: dict[str, tuple] | None = None,
) -> PublishPlan:
    """Validate the publish of ``step`` without writing anything. ``shard``: ``(rank, world)`` of a
    sharded publish (``infos``: the canonical tensors this rank touches), with the ``attempt`` id
    every rank shares."""
    r = open_root(root)
    check_receivable(infos, options, source_name)
    cat = Catalog(r)
    latest = check_free(r, cat, step)
    sharded = shard is not None
    rank, world = shard or (0, 1)
    policy = options.keyframe_policy
    if sharded and (policy.every or policy.above):
        raise UsageError(
            "the keyframe policy (restart-point snapshots) is not available for sharded publishes yet; "
            "publish a keyframe (keyframe=True) periodically instead"
        )
    attempt = layout.check_attempt(attempt) if attempt is not None else uuid.uuid4().hex
    # Why a step is a keyframe, recorded in its marker ("requested" for ranks, whose plans do not say).
    reason = ("requested" if sharded else "first step") if latest is None else "requested" if keyframe else ""
    events.reached("publish.planned", step=step, rank=rank)
    if not sharded:  # ranks report no tensor.done (their shards are not canonical tensors): no total either
        size = {k: d.itemsize for k, d in DTYPES.items()}
        events.reached("work.planned", what="publish",
                       nbytes=sum([math.prod(i.shape) * size[i.dtype] for i in infos.values()]))
    if reason:
        packed = {} if sharded else bundles.plan(infos, options.bundle_below, options.bundle_min_tensors, order)
        return PublishPlan(root, step, KEYFRAME, None, None, attempt, bundles.stored_infos(infos, packed), options,
                           source_name, reason, rank=rank, world=world, bundles=packed)
    base = cat.manifest(latest)
    diff = _schema_diff(base, infos, whole=not sharded)
    if diff:
        who = f"rank {rank}" if sharded else (source_name or "checkpoint")
        raise SchemaMismatchError(f"{who}: {diff}; publish with --keyframe to start a new lineage")
    packed = base.bundles()  # a lineage keeps its keyframe's bundles: every move of a refit shares them
    if packed and sharded:
        raise SchemaMismatchError(
            f"rank {rank}: step {base.step} stores small tensors in bundles, which sharded publishes do not "
            "write yet; publish a keyframe from the ranks (keyframe=True) to start a lineage without bundles")
    marker = cat.require_marker(latest)
    policy_reason = "" if sharded else _policy_reason(cat, latest, step, options)
    return PublishPlan(
        root, step, DELTA, StepRef(latest, marker.attempt, marker.manifest_digest), base.policy_digest, attempt,
        bundles.stored_infos(infos, packed), options, source_name, policy_reason, snapshot=bool(policy_reason),
        rank=rank, world=world, bundles=packed,
    )


def plan_from_source(root: RootRef, source: SourceRef, step: int, keyframe: bool, options: PublishOptions,
                     attempt: str | None = None) -> PublishPlan:
    """The plan of publishing a canonical source (a checkpoint path or a snapshot held here), in
    ``attempt`` (default: a fresh one)."""
    with opened(source) as src:
        order = None  # bundles in the file's order: a bundle is then one read of this file (and of the next ones)
        if isinstance(src, SafetensorsCheckpoint):
            order = src.file_order()
        plan = plan_publish(root, src.infos, step, keyframe, options, src.path, attempt=attempt, order=order)
        if not isinstance(src, SafetensorsCheckpoint):
            return plan
        try:
            kept = source_layout.capture(src).digest()
        except (source_layout.Unkept, OSError) as e:
            log.warning("%s; step %d is published without its files' own bytes: it materializes with DCR's header",
                        e, step)
            return dataclasses.replace(plan, source_file=src.path, source_layout=f"not kept: {e}")
        return dataclasses.replace(plan, source_file=src.path, source_layout=kept)


def _policy_reason(cat: Catalog, latest: int, step: int, options: PublishOptions) -> str:
    """Why the keyframe policy makes ``step`` a restart point, or "" (from the markers alone)."""
    policy = options.keyframe_policy
    if not (policy.every or policy.above):
        return ""
    s = cat.require_marker(latest).summary
    kf, chain = s.get("keyframe_step"), s.get("chain_bytes")
    kf_bytes = None
    if isinstance(kf, int) and cat.marker(kf) is not None:  # the lineage's restart point
        ks = cat.marker(kf).summary
        kf_bytes = ks.get("snapshot_bytes", ks.get("bytes_stored"))
    delta_bytes = chain - kf_bytes if isinstance(chain, int) and isinstance(kf_bytes, int) else None
    full = s.get("bytes_full") if isinstance(s.get("bytes_full"), int) else None
    return policy.due(step, kf if isinstance(kf, int) else None, delta_bytes, full) or ""
