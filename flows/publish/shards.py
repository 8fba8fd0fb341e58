"""In-memory publisher sources (torch): canonical tensors (``MemorySource``) and one rank's training
shards with their placements (``ShardedSource``).

A ``Shard`` is one local tensor as training holds it (a TP slice, an FSDP2/DTensor local shard, a
fused QKV or gate/up slice, a distributed-optimizer flat-buffer range) plus the pieces saying where
its elements live in the canonical checkpoint, and an optional residual conversion (FP32 master ->
BF16, a stored offset). ``ShardedSource.snapshot`` copies every shard's converted bits, so training
can go on while encoding runs; nothing is gathered across ranks.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from dcr_core.bits import bits_of, dtype_of, infos_of
from dcr_core.conversion import Conversion
from dcr_core.dtypes import TensorInfo
from dcr_core.errors import UsageError
from dcr_core.shard_spec import Piece, ShardSpec, c_strides
from flows import local_refs
from flows.local_refs import LocalRef


class MemorySource:
    """A snapshot (bit copy) of in-memory canonical tensors."""

    def __init__(self, tensors: Mapping[str, torch.Tensor]):
        for name, t in tensors.items():
            if not isinstance(name, str) or not isinstance(t, torch.Tensor):
                raise UsageError(f"source entry {name!r} is not a (str, torch.Tensor) pair")
        self._tensors = {n: t.detach().to("cpu", copy=True).contiguous() for n, t in tensors.items()}
        self.infos = infos_of(self._tensors)
        self.path = "<memory>"

    def bits(self, name: str) -> np.ndarray:
        return bits_of(self._tensors[name])


@dataclass(frozen=True)
class Shard:
    """A local training tensor, its pieces, and an optional elementwise conversion to canonical."""

    name: str  # training (local) name: used in errors and as the key of the rank's baseline
    tensor: torch.Tensor
    pieces: Sequence[Piece]
    conversion: Conversion | None = None


@dataclass
class ShardSnapshot:
    """Copied canonical-dtype bits of one rank's shards, ready to project."""

    rank: int
    world: int
    specs: list[ShardSpec]
    bits: list[np.ndarray]  # flat raw bits, same order as specs
    dtypes: list[str]  # canonical dtype name of each shard
    infos: dict[str, TensorInfo] = field(default_factory=dict)  # canonical tensors this rank touches
    path: str = "<shards>"

    def local_infos(self) -> list[TensorInfo]:
        """The shards as local tensors (training names and shapes, canonical dtypes)."""
        return [TensorInfo(s.local_name, dt, s.local_shape) for s, dt in zip(self.specs, self.dtypes)]


def _world_rank(rank: int | None, world: int | None) -> tuple[int, int]:
    if rank is None or world is None:
        if dist.is_available() and dist.is_initialized():
            rank = dist.get_rank() if rank is None else rank
            world = dist.get_world_size() if world is None else world
        else:
            rank, world = rank or 0, world or 1
    if not 0 <= rank < world:
        raise UsageError(f"rank {rank} is not in 0..{world - 1}")
    return rank, world


class ShardedSource:
    """One rank's shards (``rank``/``world`` default to torch.distributed's when it is initialized).
    Subclasses read shards from elsewhere (``flows.publish.dcp``, ``flows.publish.layout_file``)
    and override ``snapshot``."""

    def __init__(self, shards: Sequence[Shard], rank: int | None = None, world: int | None = None):
        self.shards = list(shards)
        self.rank, self.world = _world_rank(rank, world)
        names = [s.name for s in self.shards]
        if len(set(names)) != len(names):
            raise UsageError("two shards of one rank have the same name")
        for s in self.shards:
            if not isinstance(s.tensor, torch.Tensor):
                raise UsageError(f"shard {s.name!r}: tensor is a {type(s.tensor).__name__}, not a torch.Tensor")

    def snapshot(self) -> ShardSnapshot:
        """Copy (and convert) every shard's bits now; the trainer may modify its tensors afterwards."""
        specs, bits, dtypes, infos = [], [], [], {}
        for s in self.shards:
            if not s.pieces:
                continue  # e.g. a replica that does not own its tensor: nothing to copy or publish
            t = s.tensor.detach()
            if hasattr(t, "to_local"):  # a DTensor: its local shard
                t = t.to_local()
            t = t.to("cpu")
            if s.conversion is not None:
                out = s.conversion(t)
                out = out.clone() if out.data_ptr() == t.data_ptr() else out
            else:
                out = t.clone()  # a bit copy: training may step while this snapshot is encoded
            out = out.contiguous()
            dt = dtype_of(out)
            spec = ShardSpec(s.name, tuple(out.shape), tuple(s.pieces))
            specs.append(spec)
            bits.append(bits_of(out))
            dtypes.append(dt.name)
            for p in spec.pieces:
                info = TensorInfo(p.name, dt.name, tuple(p.shape))
                if infos.setdefault(p.name, info) != info:
                    raise UsageError(
                        f"shard {s.name!r}: tensor {p.name!r} is {dt.name}{list(p.shape)} here but "
                        f"{infos[p.name].dtype}{list(infos[p.name].shape)} in another shard"
                    )
        return ShardSnapshot(self.rank, self.world, specs, bits, dtypes, infos)


def dtensor_pieces(name: str, dt) -> list[Piece]:
    """The piece of a DTensor's local shard (``Shard(d)``/``Replicate()`` on any mesh): the box that
    ``compute_local_shape_and_global_offset`` gives; replicas other than coordinate 0 hold none."""
    # Imported here: torch.distributed.tensor costs 0.4 s of start-up, and only FSDP2 callers need it.
    from torch.distributed.tensor import Replicate  # noqa: PLC0415
    from torch.distributed.tensor import Shard as DShard  # noqa: PLC0415
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset  # noqa: PLC0415

    for pl in dt.placements:
        if type(pl) not in (Replicate, DShard):
            raise UsageError(f"{name!r}: DTensor placement {pl} is not supported (only Shard(d) and Replicate())")
    mesh = dt.device_mesh
    coord = mesh.get_coordinate()
    if coord is None or any(isinstance(pl, Replicate) and coord[i] != 0 for i, pl in enumerate(dt.placements)):
        return []
    local_shape, offset = compute_local_shape_and_global_offset(dt.shape, mesh, dt.placements)
    local_shape = tuple(int(x) for x in local_shape)
    if math.prod(local_shape) == 0:
        return []
    return [Piece(name, tuple(dt.shape), tuple(int(x) for x in offset), local_shape, 0, c_strides(local_shape))]


def snapshot_shards(source: LocalRef) -> LocalRef:
    """The step that copies (and converts) a rank's shards now, held in this process."""
    src: ShardedSource = local_refs.get(source)
    return local_refs.put(src.snapshot(), "shard snapshot")
