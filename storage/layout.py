"""The bucket layout under ROOT, keyed by step, and the validation of every key read from it.

    ROOT/run.json                                           the run's identity, bound into every marker
    ROOT/steps/<step:012d>/commit.json                      publisher commit marker (written last)
    ROOT/steps/<step:012d>/attempts/<attempt>/manifest.json JSON manifest of one publish attempt
    ROOT/steps/<step:012d>/attempts/<attempt>/source.json   the published file's own header(s) (storage.source_layout)
    ROOT/steps/<step:012d>/attempts/<attempt>/data.zarr/    Zarr v3 group, one array per tensor
    .../data.zarr/<array>/c/<i>/<j>                         a stored chunk (Zarr's default chunk keys)
    .../data.zarr/%packs/<tag>.<k:06d>                      a pack: many stored chunks back to back (packed
                                                            steps: the manifest gives each chunk's pack, offset
                                                            and size; no per-array zarr.json is written)
    .../data.zarr/<array>%parts/c/<rank>/<i>/<j>            a rank's part of a shared chunk
    ROOT/steps/<step:012d>/receivers/<receiver-id>.json     receiver commit records
    ROOT/steps/<step:012d>/leases/<receiver-id>.json        a receiver reading the step: gc keeps it
    ROOT/steps/<step:012d>/attempts/<attempt>/ranks/<r>.json partial manifest of rank r (sharded publish)
    ROOT/steps/<step:012d>/attempts/<attempt>/failed.json   a rank of a sharded publish gave up
    ROOT/steps/<step:012d>/attempts/<attempt>/stream/<k:06d>.json  the k-th index of chunks stored so far
    ROOT/building.json                                      the step a publisher is writing now (storage.stream)
    ROOT/receivers/<receiver-id>.json                       where each receiver is now (its latest commit record)
    ROOT/prepared/<receiver-id>.json                        a vLLM receiver's last background prepare: done or failed
    ROOT/fleets/<name>.json                                 the version a fleet of engines serves (storage.fleet)
    ROOT/fleets/<name>/records/<generation:012d>.json       each record of the fleet, created only if absent
    ROOT/fleets/<name>/lease/<epoch:012d>.json              its coordinators' leases (storage.fleet_lease)

Every publish writes into a fresh attempt prefix, so a crashed or losing publisher never
overwrites what another attempt wrote; only the attempt named by ``commit.json`` is real.
"""

from __future__ import annotations

import re

import blake3

from dcr_core.errors import UnsafeKeyError, UsageError

STEP_WIDTH = 12
MAX_STEP = 10**STEP_WIDTH - 1
STEPS = "steps"
RUN = "run.json"  # the ROOT's run identity (storage.run_identity)
COMMIT = "commit.json"
RETRACTED = "retracted.json"  # a committed step taken back (storage.retraction)
MANIFEST = "manifest.json"
SOURCE = "source.json"  # the published safetensors file's header bytes, for byte-identical materialization
STORE = "data.zarr"
BUILDING = "building.json"  # the step being written now: a hint for streaming receivers, never trusted
STREAM = "stream"

_ATTEMPT = re.compile(r"^[0-9a-f]{16,64}$")
_RECEIVER = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
MAX_ARRAY_SEGMENT = 200
_SEGMENT = re.compile(r"^[A-Za-z0-9_.%-]{1,255}$")
_PLAIN = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]*\Z")  # an array name as it is: no escape, no leading dot


def check_step(step: int) -> int:
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= MAX_STEP:
        raise UsageError(f"step must be an integer in 0..{MAX_STEP}, got {step!r}")
    return step


def check_receiver(receiver_id: str) -> str:
    if not isinstance(receiver_id, str) or not _RECEIVER.match(receiver_id):
        raise UsageError(
            f"receiver id {receiver_id!r} must be 1-128 characters of [A-Za-z0-9._-], "
            "starting with a letter or digit"
        )
    return receiver_id


def check_attempt(attempt: str) -> str:
    if not isinstance(attempt, str) or not _ATTEMPT.match(attempt):
        raise UnsafeKeyError(f"attempt id {attempt!r} is not 16-64 lowercase hex digits")
    return attempt


def check_segment(segment: object, what: str) -> str:
    """A single path segment taken from stored metadata: no separators, no ``.``/``..``."""
    if not isinstance(segment, str) or not _SEGMENT.match(segment) or segment in (".", ".."):
        raise UnsafeKeyError(f"{what} {segment!r} is not a safe path segment")
    return segment


def step_dir(step: int) -> str:
    return f"{STEPS}/{check_step(step):0{STEP_WIDTH}d}"


def parse_step_dir(name: str) -> int | None:
    """The step of a ``steps/`` child name, or None if it is not one of ours."""
    return int(name) if len(name) == STEP_WIDTH and name.isascii() and name.isdigit() else None


def retraction_key(step: int) -> str:
    return f"{step_dir(step)}/{RETRACTED}"


def commit_key(step: int) -> str:
    return f"{step_dir(step)}/{COMMIT}"


def attempts_dir(step: int) -> str:
    return f"{step_dir(step)}/attempts"


def attempt_dir(step: int, attempt: str) -> str:
    return f"{step_dir(step)}/attempts/{check_attempt(attempt)}"


def manifest_key(step: int, attempt: str) -> str:
    return f"{attempt_dir(step, attempt)}/{MANIFEST}"


def source_key(step: int, attempt: str) -> str:
    """The source layout of an attempt published from a safetensors file or directory."""
    return f"{attempt_dir(step, attempt)}/{SOURCE}"


def ranks_dir(step: int, attempt: str) -> str:
    return f"{attempt_dir(step, attempt)}/ranks"


def rank_partial_key(step: int, attempt: str, rank: int) -> str:
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < 1 << 16:
        raise UsageError(f"rank must be an integer in 0..65535, got {rank!r}")
    return f"{ranks_dir(step, attempt)}/{rank}.json"


def attempt_failed_key(step: int, attempt: str) -> str:
    return f"{attempt_dir(step, attempt)}/failed.json"


def stream_key(step: int, attempt: str, seq: int) -> str:
    """The ``seq``-th stream index of an attempt (``storage.stream``)."""
    if isinstance(seq, bool) or not isinstance(seq, int) or not 0 <= seq < 10**6:
        raise UsageError(f"stream index must be an integer in 0..999999, got {seq!r}")
    return f"{attempt_dir(step, attempt)}/{STREAM}/{seq:06d}.json"


def store_dir(step: int, attempt: str) -> str:
    return f"{attempt_dir(step, attempt)}/{STORE}"


def chunk_key(array: str, grid_index: tuple[int, ...]) -> str:
    """A chunk object's key inside a step's store: Zarr v3's default encoding, ``<array>/c/i/j``
    (``<array>/c`` for a 0-d array)."""
    return "/".join([array, "c", *map(str, grid_index)])


def part_key(parts_array: str, slot: int, grid_index: tuple[int, ...]) -> str:
    """A part object's key inside a step's store: chunk ``(slot, *grid_index)`` of the parts array."""
    return chunk_key(parts_array, (slot, *grid_index))


PACKS = "%packs"  # a packed step's pack objects, in its store (array_segment never yields "%p")
_PACK = re.compile(r"^[0-9a-f]{8}\.[0-9]{6}$")


def check_pack(name: str) -> str:
    """A pack's name from a manifest: ``<writer tag: 8 hex digits>.<6 digits>``."""
    if not isinstance(name, str) or not _PACK.match(name):
        raise UnsafeKeyError(f"pack name {name!r} is not <8 hex digits>.<6 digits>")
    return name


def range_ident(key: str, offset: int | None) -> str:
    """What names a stored chunk among prefetched ones: its object's key, and a packed chunk's offset."""
    return key if offset is None else f"{key}@{offset}"


def pack_key(name: str) -> str:
    """A pack object's key inside a step's store: many stored chunks, back to back (packed steps)."""
    return f"{PACKS}/{check_pack(name)}"


PARTS_SUFFIX = "%parts"  # array_segment never yields "%p", so no tensor's array can end like this
SNAPSHOT_SUFFIX = ".full"  # a restart point's full copy of a tensor, beside its delta array


def parts_array(array: str) -> str:
    return array + PARTS_SUFFIX


def array_meta_key(array: str) -> str:
    return f"{array}/zarr.json"


GROUP_META = "zarr.json"


def store_key(step: int, attempt: str, key_in_store: str) -> str:
    """A key under ROOT for an object of a step's store (``key_in_store`` from the functions above)."""
    return f"{store_dir(step, attempt)}/{key_in_store}"


def receivers_dir(step: int) -> str:
    return f"{step_dir(step)}/receivers"


def leases_dir(step: int) -> str:
    return f"{step_dir(step)}/leases"


def lease_key(step: int, receiver_id: str) -> str:
    return f"{leases_dir(step)}/{check_receiver(receiver_id)}.json"


def receiver_key(step: int, receiver_id: str) -> str:
    return f"{receivers_dir(step)}/{check_receiver(receiver_id)}.json"


POSITIONS_DIR = "receivers"  # receivers/<id>.json: where each receiver is now


def position_key(receiver_id: str) -> str:
    return f"{POSITIONS_DIR}/{check_receiver(receiver_id)}.json"


PREPARED_DIR = "prepared"  # prepared/<id>.json: a receiver's last background prepare (advisory: for a fleet)


def prepared_key(receiver_id: str) -> str:
    return f"{PREPARED_DIR}/{check_receiver(receiver_id)}.json"


FLEETS_DIR = "fleets"  # fleets/<name>.json: the version a fleet of engines serves (storage.fleet)


def fleet_key(name: str) -> str:
    if not isinstance(name, str) or not _RECEIVER.match(name):
        raise UsageError(f"fleet name {name!r} must be 1-128 characters of [A-Za-z0-9._-], starting with a letter or digit")
    return f"{FLEETS_DIR}/{name}.json"


def fleet_dir(name: str) -> str:
    """``fleets/<name>``: the fleet's records by generation and its coordinators' leases by epoch."""
    fleet_key(name)
    return f"{FLEETS_DIR}/{name}"


def fleet_records_dir(name: str) -> str:
    return f"{fleet_dir(name)}/records"


def fleet_leases_dir(name: str) -> str:
    return f"{fleet_dir(name)}/lease"


def numbered_key(directory: str, number: int) -> str:
    """``<directory>/<number:012d>.json``: a fleet's record generation or lease epoch."""
    if isinstance(number, bool) or not isinstance(number, int) or not 0 <= number <= MAX_STEP:
        raise UsageError(f"{directory}: {number!r} is not a number in 0..{MAX_STEP}")
    return f"{directory}/{number:0{STEP_WIDTH}d}.json"


def parse_numbered(name: str) -> int | None:
    """The number of a ``numbered_key`` object's name (``000000000007.json``: 7); None for any other name."""
    stem, _, ext = name.partition(".")
    if ext != "json" or len(stem) != STEP_WIDTH or not stem.isascii() or not stem.isdigit():
        return None
    return int(stem)


def array_segment(name: str) -> str:
    """The Zarr array name for a tensor: the tensor name, percent-escaped outside [A-Za-z0-9._-]."""
    if len(name) <= MAX_ARRAY_SEGMENT and _PLAIN.match(name):
        return name  # nothing to escape (most names: one pass in C instead of one per character)
    out = []
    for ch in name:
        if ch.isascii() and (ch.isalnum() or ch in "._-"):
            out.append(ch)
        else:
            out.extend(f"%{b:02X}" for b in ch.encode())
    seg = "".join(out)
    if seg.startswith("."):
        seg = "%2E" + seg[1:]
    if not seg:
        seg = "%00"
    if len(seg) > MAX_ARRAY_SEGMENT:
        # Too long for a file or object name segment: keep a readable prefix, make it unique by digest.
        digest = blake3.blake3(name.encode()).hexdigest()[:16]
        seg = f"{seg[: MAX_ARRAY_SEGMENT - 17]}-{digest}"
    return seg
