"""Scenario files of ``dcr simulate``: TOML, validated strictly (unknown keys and bad values are errors).

Units: bandwidths in MB/s (10^6 bytes per second), latencies in ms, CPU throughputs in GB/s
(10^9 bytes per second) of *raw model bytes* per thread, sizes in bytes. See ``docs/simulate.md``.
"""

from __future__ import annotations

import json
import math
import os
import tomllib
from typing import Literal

from dcr_zarr_codec.metadata import SPARSE_CODEC, codec_name
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

MODES = ("full", "direct", "tree")
COSTS = ("encode_gb_per_s", "decode_apply_gb_per_s", "digest_gb_per_s", "copy_gb_per_s")
TENSOR_COSTS = ("publish_s_per_tensor", "receive_s_per_tensor")
# A calibration's per-tensor costs, measured apart for each step layout: the section a scenario takes.
PER_TENSOR_SECTION = {"packed": "per_tensor", "per-object": "per_tensor_per_object"}
DTYPE_OF_WIDTH = {1: "float8", 2: "bfloat16", 4: "float32", 8: "float64"}
DEFAULT_CALIBRATION = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "scenarios",
                                   "calibration.json")


class ScenarioError(ValueError):
    """A scenario (or calibration, or record) that cannot be used: the message is one line."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelSpec(_Strict):
    parameters: float = Field(gt=0, description="parameters of the model (canonical elements)")
    bytes_per_param: Literal[1, 2, 4, 8] = Field(description="stored bytes per element: 2 for BF16, 4 for FP32")
    change_rate: float = Field(gt=0, le=1, description="fraction of elements whose stored bits change in a step")
    bytes_per_change: float = Field(gt=0, le=64, description="encoded delta bytes per changed element")
    chunk_bytes: int = Field(4 << 20, ge=1024, le=1 << 30, description="raw bytes per chunk (DCR's default 4 MiB)")
    tensors: int = Field(1, ge=1, description="named tensors, taken as equal in size: chunks do not cross tensors, "
                         "and each costs CPU per tensor and, in the per-object layout, an array document")
    full_part_bytes: int = Field(64 << 20, ge=1 << 20, description="object (or multipart part) size of the full checkpoint")
    layout: Literal["per-object", "packed"] = Field(
        "packed", description="how a step stores its chunks: concatenated into packs (manifest schema 3, dcr "
        "publish's default), or one object per chunk plus one array document per changed tensor (schema 1-2, "
        "dcr publish --pack-bytes 0); it also picks the calibration's per-tensor costs")
    pack_bytes: int = Field(8 << 20, ge=1024, le=1 << 34, description="packed: stored bytes at which a pack is sealed "
                            "(PublishOptions.pack_bytes)")
    fixed_objects: int = Field(0, ge=0, le=1_000_000, description="objects of every step that do not scale with it, "
                               "beyond the round trips in [overhead] (source.json, stream indexes, a group document): "
                               "written, copied and read once each; 0 where a measured fixed overhead holds them")
class LinkSpec(_Strict):
    mb_per_s: float = Field(gt=0, description="bandwidth, MB/s (10^6 B/s); inf for no limit")
    latency_ms: float = Field(0.0, ge=0, description="per-request time not spent moving bytes (round trip, server)")
    scope: Literal["per_receiver", "per_region", "global"] = Field(
        "per_region", description="who shares one instance of the link: each receiver its own, one per region, one for all")

    @property
    def bytes_per_s(self) -> float:
        return self.mb_per_s * 1e6

    @property
    def latency_s(self) -> float:
        return self.latency_ms / 1e3


class Links(_Strict):
    uplink: LinkSpec = Field(description="publisher -> origin store")
    inter_region: LinkSpec = Field(description="origin store -> a region (its mirror, or its receivers in direct mode)")
    receiver: LinkSpec = Field(description="a region's store -> its receivers")
    # the origin's own egress (e.g. a single test proxy): shared by every read of the origin
    origin_egress: LinkSpec | None = None


class Topology(_Strict):
    regions: int = Field(1, ge=1, le=10_000, description="receiving regions (each with its own mirror in tree mode)")
    receivers_per_region: int = Field(1, ge=1, le=1_000_000)
    full_via: Literal["direct", "tree"] = Field(
        "direct", description="how the full-checkpoint reference reaches receivers: from the origin, or through mirrors")


class CpuSpec(_Strict):
    """Per-byte CPU costs, as throughputs per thread in GB/s of raw model bytes, and per-tensor CPU
    seconds; or ``from_calibration``."""

    from_calibration: str | None = Field(None, description="a calibration JSON, relative to the scenario file")
    codec: str = Field(SPARSE_CODEC, description="which codec's costs to take from the calibration")
    encode_gb_per_s: float | None = Field(None, gt=0, description="publisher: XOR + compress (+ chunk digest)")
    decode_apply_gb_per_s: float | None = Field(None, gt=0, description="receiver: decompress + apply")
    digest_gb_per_s: float | None = Field(None, gt=0, description="one BLAKE3 pass over raw bytes")
    copy_gb_per_s: float | None = Field(None, gt=0, description="one copy of raw bytes into fresh memory "
                                        "(publisher: snapshot of the new policy; receiver: installing the result)")
    publisher_threads: float = Field(1.0, gt=0, description="parallel CPU of the publisher (all its ranks)")
    receiver_threads: float = Field(1.0, gt=0, description="parallel CPU of one receiver")
    publish_s_per_tensor: float | None = Field(
        None, ge=0, description="publisher CPU seconds per changed tensor beyond its bytes (the calibration's "
        "costs of the scenario's layout: per_tensor for packed, per_tensor_per_object for per-object; 0 without them)")
    receive_s_per_tensor: float | None = Field(
        None, ge=0, description="receiver CPU seconds per changed tensor beyond its bytes (as above)")
    publisher_processes: int = Field(
        1, ge=1, le=1_000_000, description="processes a publish's tensors are split among: per-tensor work is "
        "Python under one interpreter lock per process, so threads do not divide it")
    receiver_processes: int = Field(1, ge=1, le=1_000_000, description="processes of one receiver (as above)")

    @model_validator(mode="after")
    def _complete(self) -> CpuSpec:
        literal = [getattr(self, k) for k in COSTS]
        if self.from_calibration is None and any(x is None for x in literal):
            raise ValueError(f"give {', '.join(COSTS)}, or from_calibration")
        return self


class IoSpec(_Strict):
    workers: int = Field(8, ge=1, le=100_000, description="concurrent requests per publisher, mirror or receiver")
    discovery_s: float = Field(0.0, ge=0, description="time for a reader to notice a new object (half a poll interval)")
    overlap_cpu_and_io: bool = Field(
        True, description="an actor's CPU work overlaps its own requests; false where its requests cost it CPU "
        "and do not overlap (a measured effective concurrency of 1)")
    store_mb_per_s: float = Field(
        float("inf"), gt=0,
        description="a store's own processing rate per object, after the bytes arrived (a test server's CPU); "
        "inf for a real object store")
    shared_cores: int | None = Field(
        None, ge=1, le=100_000,
        description="every actor and the store run on one machine with this many cores (a local measurement): "
        "work that streaming overlaps cannot take less than its CPU time over these cores; unset: each actor "
        "has cores of its own")


class RequestSpec(_Strict):
    """What a store charges per request, apart from the bytes: its own time, and its rate limits."""

    store_ms: float = Field(0.0, ge=0, description="a store's own time per request, added to each request's latency")
    put_per_s: float = Field(float("inf"), gt=0, description="PUTs per second a store accepts per prefix, from all "
                             "its writers (S3: 3,500); inf for no limit")
    get_per_s: float = Field(float("inf"), gt=0, description="GETs per second a store serves per prefix, to all its "
                             "readers (S3: 5,500); inf for no limit")
    prefixes: int = Field(1, ge=1, le=1_000_000, description="prefixes a step's objects spread over (1: every object "
                          "of a step is under its attempt's prefix)")


class Overhead(_Strict):
    """Fixed costs of a refit that do not scale with its bytes (see the model's docstring)."""

    publish_s: float = Field(0.0, ge=0, description="publisher: snapshot, plan, bookkeeping (once per refit)")
    receive_s: float = Field(0.0, ge=0, description="receiver: plan, leases, state-file bookkeeping")
    mirror_s: float = Field(0.0, ge=0, description="mirror: plan and bookkeeping")
    publish_round_trips: int = Field(2, ge=0, description="sequential requests of a publish (manifest, commit marker)")
    receive_round_trips: int = Field(4, ge=0, description="sequential requests of a receive (chain, leases, marker)")
    install_copies: float = Field(
        1.0, ge=0, description="passes over the model to install a result: 1 for a rewritten state file or a "
        "swapped staged copy, 0 for an in-place patch")
    mirror_round_trips: int = Field(3, ge=0, description="sequential requests of a mirror copy (plan, manifest, marker)")


class RunSpec(_Strict):
    modes: list[Literal["full", "direct", "tree"]] = Field(default_factory=lambda: list(MODES))
    streaming: list[bool] = Field(default_factory=lambda: [False, True])


class Scenario(_Strict):
    name: str = ""
    description: str = ""
    model: ModelSpec
    topology: Topology = Field(default_factory=Topology)
    links: Links
    cpu: CpuSpec
    io: IoSpec = Field(default_factory=IoSpec)
    requests: RequestSpec = Field(default_factory=RequestSpec)
    overhead: Overhead = Field(default_factory=Overhead)
    run: RunSpec = Field(default_factory=RunSpec)


def _where(err: dict) -> str:
    return ".".join(str(x) for x in err["loc"]) or "scenario"


def _one_line(source: str, e: ValidationError) -> ScenarioError:
    err = e.errors()[0]
    msg = err["msg"]
    if err["type"] == "extra_forbidden":
        msg = "unknown field"
    more = f" (and {e.error_count() - 1} more)" if e.error_count() > 1 else ""
    return ScenarioError(f"{source}: {_where(err)}: {msg}{more}")


def parse(data: dict, source: str = "scenario", base_dir: str | None = None) -> Scenario:
    """A validated ``Scenario`` from a mapping; CPU costs from a calibration file are filled in."""
    try:
        sc = Scenario.model_validate(data)
    except ValidationError as e:
        raise _one_line(source, e) from None
    if sc.cpu.from_calibration is not None:
        sc = _with_calibration(sc, source, base_dir or os.getcwd())
    return sc


def load(path: str) -> Scenario:
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as e:
        raise ScenarioError(f"{path}: cannot read: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise ScenarioError(f"{path}: not TOML: {e}") from None
    if not data.get("name"):
        data["name"] = os.path.splitext(os.path.basename(path))[0]
    return parse(data, path, os.path.dirname(os.path.abspath(path)))


def _with_calibration(sc: Scenario, source: str, base_dir: str) -> Scenario:
    ref = sc.cpu.from_calibration
    path = ref if os.path.isabs(ref) else os.path.join(base_dir, ref)
    try:
        with open(path) as f:
            cal = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ScenarioError(f"{source}: cpu.from_calibration: cannot read {path}: {e}") from None
    dtype = DTYPE_OF_WIDTH[sc.model.bytes_per_param]
    costs = {codec_name(c): d for c, d in cal.get("costs", {}).items()}  # calibrations of former names too
    entry = costs.get(codec_name(sc.cpu.codec), {}).get(dtype)
    if entry is None:
        have = {c: sorted(d) for c, d in costs.items()}
        raise ScenarioError(f"{source}: cpu.from_calibration: {path} has no {sc.cpu.codec}/{dtype} costs (has {have})")
    per_tensor = cal.get(PER_TENSOR_SECTION[sc.model.layout], {})
    fill = {k: getattr(sc.cpu, k) if getattr(sc.cpu, k) is not None else entry[k] for k in COSTS}
    fill |= {k: getattr(sc.cpu, k) if getattr(sc.cpu, k) is not None else per_tensor.get(k) for k in TENSOR_COSTS}
    try:
        cpu = CpuSpec.model_validate({**sc.cpu.model_dump(), **fill, "from_calibration": None})
    except ValidationError as e:
        raise _one_line(f"{source}: cpu.from_calibration: {path}", e) from None
    return sc.model_copy(update={"cpu": cpu})


def to_dict(sc: Scenario) -> dict:
    """The scenario as plain data (infinite bandwidths as the string "inf", which TOML and JSON both take)."""
    def fix(x):
        if isinstance(x, dict):
            return {k: fix(v) for k, v in x.items()}
        if isinstance(x, list):
            return [fix(v) for v in x]
        return "inf" if isinstance(x, float) and math.isinf(x) else x
    return fix(sc.model_dump(exclude_none=True))
