"""Typed options of the publisher, the receiver and gc: pydantic models, validated on construction.

The same models are the parameters of the Prefect flows, so a deployment (or the Prefect UI,
which renders their JSON schema) passes them as plain mappings, e.g.
``{"io_workers": 4, "chunk_bytes": 1048576}``, and gets them checked field by field. Built in
Python with a bad value they raise ``UsageError`` (one line naming the field).
"""

from __future__ import annotations

import os

from dcr_zarr_codec.metadata import BLOSC_CODEC, COND_CODEC, SPARSE_CODEC
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from dcr_core import bundles
from dcr_core.codec import CodecSpec
from dcr_core.digest import DEFAULT_BLOCK_BYTES
from dcr_core.errors import UsageError
from dcr_core.retention import KeyframePolicy
from storage import credentials, leases
from storage.chunk_io import IO_WORKERS

DEFAULT_CHUNK_BYTES = 4 << 20
# Measured on real AdamW deltas (lr 1e-6, 1.7% changed): dcr.sparse level 1 stores 1.36 B per
# changed element (entropy bound 1.26); the standard Blosc chain below stores 2.35.
SPARSE_DELTAS = CodecSpec(name=SPARSE_CODEC, clevel=1)
# Standard-only chain for deltas that any zarr reads without this package (audits): byte shuffle
# beats bit shuffle on XOR masks, and 1 MiB blocks give zstd more context than Blosc's default.
BLOSC_DELTAS = CodecSpec(name=BLOSC_CODEC, clevel=1, shuffle="shuffle", blocksize=1 << 20)
# Coded against the receiver's old bits (positions per exponent class, signed ulp steps): below the
# XOR entropy bound (0.71-0.77x of it on the bench's AdamW steps); decodes only with the held bits, so
# stock zarr cannot read its arrays as masks, and training ranks (which hold shards) cannot publish it.
COND_DELTAS = CodecSpec(name=COND_CODEC, clevel=3)
# Keyframes: bit shuffle then zstd level 1. On BF16 weights (64 MB, one thread) it keeps 98% of the
# ratio of byte shuffle + zstd level 3 (1.32 against 1.35) and encodes 4.8x faster (1.16 against
# 0.24 GB/s), decodes 5.5x faster (3.7 against 0.68 GB/s). Older ROOTs keep the codec their manifests name.
KEYFRAMES = CodecSpec(clevel=1, shuffle="bitshuffle")
DELTA_CODECS = {"sparse": SPARSE_DELTAS, "cond": COND_DELTAS, "blosc": BLOSC_DELTAS}


def default_cache_dir() -> str:
    return os.environ.get("DCR_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "dcr"
    )


class _Options(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    def __init__(self, **data) -> None:
        try:
            super().__init__(**data)
        except ValidationError as e:
            err = e.errors()[0]
            where = ".".join(str(x) for x in err["loc"]) or type(self).__name__
            raise UsageError(f"{type(self).__name__}: {where}: {err['msg']}") from None


class PublishOptions(_Options):
    chunk_bytes: int = Field(DEFAULT_CHUNK_BYTES, ge=1, le=1 << 30, description="raw bytes per chunk")
    column_blocks: int = Field(
        1, ge=1, le=1024, description="tile tensors larger than a chunk into this many column blocks of "
        "their last dim (where it divides it) and at least as many row blocks, so that tensor-parallel "
        "receiver ranks (TP dividing it) pull only their own slices of row- and column-parallel weights; "
        "1: contiguous chunks (see dcr_core.chunking)",
    )
    keyframe_codec: CodecSpec = Field(default_factory=lambda: KEYFRAMES, description="codec of keyframes")
    delta_codec: CodecSpec = Field(default_factory=lambda: SPARSE_DELTAS, description="codec of deltas")
    # Default 1.0: never. XOR masks are self-inverse (receivers can step back) and cost about the
    # same as new values even when everything changed; overwrites are for callers that need them.
    overwrite_above: float = Field(
        1.0, ge=0.0, le=1.0,
        description="store new values instead of an XOR mask when more than this fraction of a tensor changed",
    )
    io_workers: int = Field(IO_WORKERS, ge=1, le=1024, description="parallel object writes and reads")
    cache_dir: str = Field(default_factory=default_cache_dir, description="the publisher's baseline cache")
    use_cache: bool = Field(True, description="keep the committed step as the next baseline on local disk")
    keyframe_policy: KeyframePolicy = Field(
        default_factory=KeyframePolicy, description="when a delta step also stores a full snapshot (a restart point)",
    )
    digest_block_bytes: int | None = Field(
        DEFAULT_BLOCK_BYTES, ge=1 << 12, le=1 << 30, multiple_of=8,
        description="tensor digests over blocks of this many bytes (manifest schema 2: receivers that keep "
        "the block digests of their state re-hash only the blocks a refit changes); None: flat digests "
        "(schema 1, what DCR before block digests reads)",
    )
    stream: bool = Field(
        True, description="expose chunks as they are stored (building.json, stream indexes) so following "
        "receivers fetch them before the commit",
    )
    pack_bytes: int = Field(
        8 << 20, ge=0, le=1 << 30, description="stored chunks go into shared pack objects of at least this many "
        "bytes (manifest schema 3: objects and requests per step follow its bytes, not its tensors); 0: one "
        "object per chunk and a zarr.json per array, the layout before packs",
    )
    bundle_below: int = Field(
        bundles.DEFAULT_BELOW_BYTES, ge=0, le=1 << 30, description="tensors smaller than this many bytes are stored "
        "in bundles, one flat tensor per dtype (manifest schema 4: the cost of a step follows its bytes, not its "
        "tensor count), when a dtype holds at least bundle_min_tensors of them; decided by each keyframe, kept "
        "by its deltas; 0: never",
    )
    bundle_min_tensors: int = Field(
        bundles.DEFAULT_MIN_TENSORS, ge=2, le=1 << 30, description="bundle a dtype's small tensors only when it "
        "holds at least this many (fewer stay one manifest entry each, easier to read)",
    )
    group_bytes: int | None = Field(
        None, ge=1, description="on workers (flows.workers): raw bytes of tensors per mapped encoding task; None: "
        "one task per worker thread, of near-equal bytes, more only where each holds 1 GiB (flows.publish.groups)",
    )


class ReceiveOptions(_Options):
    io_workers: int = Field(IO_WORKERS, ge=1, le=1024, description="parallel object reads")
    # Patch the state file in place (a journal, only the changed elements written) instead of
    # rewriting it and renaming it into place; see flows.receive.in_place for the trade-off.
    in_place: bool = Field(False, description="patch the state file in place behind a journal")
    lease_seconds: float = Field(
        leases.DEFAULT_TTL, gt=0.0, le=leases.MAX_TTL, allow_inf_nan=False,
        description="how long gc keeps the steps a refit reads (its leases), at most (storage.leases.MAX_TTL)",
    )
    max_staleness: float | None = Field(
        None, gt=0.0, allow_inf_nan=False,
        description="refuse a ROOT whose newest signed heartbeat is older than this many seconds (storage.heartbeat)",
    )
    require_signed: bool = Field(
        False, description="refuse to read ROOT without a key to verify its commit markers with: never apply a step "
        "whose signature was not checked (as DCR_REQUIRE_SIGNED=1 does for every reader of the process)",
    )
    group_bytes: int | None = Field(
        None, ge=1, description="materialize on workers (flows.workers): raw bytes of tensors per mapped task; None: "
        "one task per worker thread, of near-equal bytes, more only where each holds 1 GiB (dcr_core.batches)",
    )
    as_state: bool = Field(
        False, description="materialize: write a file in DCR's state format (dcr.* metadata, room to patch it) "
        "even for a step published from a safetensors file or directory, whose bytes it otherwise writes exactly",
    )


class GcOptions(_Options):
    keep_last: int = Field(ge=1, description="keep the newest K committed steps and the chains to rebuild them")
    grace_seconds: float = Field(
        3600.0, ge=0.0, description="leave uncommitted attempts younger than this alone (a publisher may be writing them)",
    )
    dry_run: bool = Field(False, description="report what would be deleted; delete nothing")




def refuse_credentials(storage_options: dict | None, name: str = "storage_options") -> None:
    """A flow's parameters are stored in Prefect's database (and shown in its UI): refuse a
    credential among them (``storage.credentials``: the rule), in one line naming it. Credentials
    come from the environment of the process or work pool that runs the flow (``AWS_ACCESS_KEY_ID``,
    ``GOOGLE_APPLICATION_CREDENTIALS``, ...) or from a Prefect block the flow loads there."""
    found = credentials.find_credential(storage_options)
    if found is not None:
        here = name + "".join(f"[{k!r}]" for k in found)
        raise UsageError(f"{here}: a credential in a flow parameter is stored in Prefect's database; "
                         "give it through the environment of the work pool (AWS_ACCESS_KEY_ID, ...) or a "
                         "Prefect block instead")
