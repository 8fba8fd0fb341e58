"""Per-rank safetensors files plus a layout file, as a sharded source.

A trainer (or a conversion script) that saves each rank's local tensors to its own safetensors
file describes where they go in a layout file (JSON), and ``dcr publish ROOT LAYOUT.json --step N``
publishes them rank by rank from one process, like a DCP directory::

    {
      "format": "dcr-shard-layout",
      "world": 2,
      "ranks": [
        {"file": "rank0.safetensors",            # relative to the layout file
         "shards": [
           {"name": "decoder.layers.0.self_attention.linear_qkv.weight",
            "placement": {"kind": "fused_qkv", "q": "model.layers.0.self_attn.q_proj.weight",
                          "k": "...k_proj.weight", "v": "...v_proj.weight",
                          "num_heads": 32, "num_groups": 8, "head_dim": 128, "rest": [4096],
                          "tp_rank": 0, "tp": 2}},
           {"name": "decoder.layers.0.mlp.linear_fc2.weight",
            "placement": {"kind": "split", "tensor": "model.layers.0.mlp.down_proj.weight",
                          "shape": [4096, 14336], "splits": {"1": [0, 2]}},
            "conversion": "bf16"}
         ]},
        ...
      ]
    }

Placement kinds: ``split`` (``splits``: dim -> [rank, world], optional ``sizes``: dim -> list),
``replicate`` (``tensor``, ``shape``, ``rank``, ``owner``), ``fused_qkv``, ``gated_fc1`` (``gate``,
``up``, ``ffn``, ``rest``, ``tp_rank``, ``tp``), and ``pieces`` (explicit affine pieces: ``tensor``,
``shape``, ``start``, ``extent``, ``offset``, ``strides``). ``conversion`` names a registered
conversion (``dcr_core.conversion``: ``bf16``, ``norm_minus_one_bf16``, or one you register).
"""

from __future__ import annotations

import json
import os

from dcr_core import conversion as conv
from dcr_core.bits import tensor_from_bits
from dcr_core.dtypes import DTYPES
from dcr_core.errors import InvalidCheckpointError, UsageError
from dcr_core.shard_spec import Piece, fused_qkv, gated_fc1, replicate, split
from dcr_core.text import plural
from flows.publish.shards import Shard, ShardedSource, ShardSnapshot
from flows.publish.sources import LAYOUT_FORMAT
from storage.local.safetensors import SafetensorsCheckpoint

MAX_LAYOUT_BYTES = 256 << 20


def pieces_of(placement: dict, what: str) -> list[Piece]:
    """The pieces of one placement entry of a layout file."""
    if not isinstance(placement, dict):
        raise UsageError(f"{what}: placement must be an object")
    kind = placement.get("kind")
    p = placement
    try:
        if kind == "split":
            splits = {int(d): tuple(v) for d, v in p.get("splits", {}).items()}
            sizes = {int(d): list(v) for d, v in p["sizes"].items()} if p.get("sizes") else None
            return split(p["tensor"], tuple(p["shape"]), splits, sizes)
        if kind == "replicate":
            return replicate(p["tensor"], tuple(p["shape"]), int(p["rank"]), int(p.get("owner", 0)))
        if kind == "fused_qkv":
            return fused_qkv(p["q"], p["k"], p["v"], int(p["num_heads"]), int(p["num_groups"]), int(p["head_dim"]),
                             tuple(p.get("rest", ())), int(p.get("tp_rank", 0)), int(p.get("tp", 1)))
        if kind == "gated_fc1":
            return gated_fc1(p["gate"], p["up"], int(p["ffn"]), tuple(p.get("rest", ())), int(p.get("tp_rank", 0)), int(p.get("tp", 1)))
        if kind == "pieces":
            return [Piece(x["tensor"], tuple(x["shape"]), tuple(x["start"]), tuple(x["extent"]), int(x["offset"]),
                          tuple(x["strides"])) for x in p["pieces"]]
    except (KeyError, TypeError, ValueError) as e:
        raise UsageError(f"{what}: bad {kind!r} placement ({type(e).__name__}: {e})") from None
    raise UsageError(f"{what}: unknown placement kind {kind!r}")


class FileRankSource(ShardedSource):
    """One rank's safetensors file and its shards' placements (read at snapshot time)."""

    def __init__(self, path: str, entries: list[dict], rank: int, world: int, where: str):
        self.file, self.entries, self.rank, self.world, self.where = path, entries, rank, world, where
        self.shards = []

    def snapshot(self) -> ShardSnapshot:
        shards = []
        with SafetensorsCheckpoint(self.file) as ck:
            for i, e in enumerate(self.entries):
                what = f"{self.where} rank {self.rank} shard {i}"
                if not isinstance(e, dict) or not isinstance(e.get("name"), str):
                    raise UsageError(f"{what}: needs a name")
                if e["name"] not in ck.infos:
                    raise InvalidCheckpointError(f"{self.file}: has no tensor {e['name']!r} (named in {self.where})")
                c = conv.named(e["conversion"]) if e.get("conversion") else None
                info = ck.infos[e["name"]]
                t = tensor_from_bits(ck.bits(e["name"]), DTYPES[info.dtype], info.shape)
                shards.append(Shard(e["name"], t, pieces_of(e.get("placement"), what), c))
        return ShardedSource(shards, self.rank, self.world).snapshot()


def layout_sources(path) -> list[FileRankSource]:
    """One source per rank of the layout file at ``path``."""
    path = os.fspath(path)
    try:
        if os.path.getsize(path) > MAX_LAYOUT_BYTES:
            raise InvalidCheckpointError(f"{path}: layout file larger than {MAX_LAYOUT_BYTES} bytes")
        with open(path, "rb") as f:
            d = json.loads(f.read())
    except OSError as e:
        raise InvalidCheckpointError(f"{path}: cannot read ({e.strerror or e})") from None
    except (ValueError, RecursionError):
        raise InvalidCheckpointError(f"{path}: layout file is not valid JSON") from None
    if not isinstance(d, dict) or d.get("format") != LAYOUT_FORMAT or not isinstance(d.get("ranks"), list):
        raise InvalidCheckpointError(f"{path}: not a {LAYOUT_FORMAT} file")
    world = d.get("world", len(d["ranks"]))
    if world != len(d["ranks"]) or not d["ranks"]:
        raise InvalidCheckpointError(f"{path}: world {world!r} but {plural(len(d['ranks']), 'rank')} listed")
    base = os.path.dirname(os.path.abspath(path))
    out = []
    for r, rk in enumerate(d["ranks"]):
        if not isinstance(rk, dict) or not isinstance(rk.get("file"), str) or not isinstance(rk.get("shards"), list):
            raise InvalidCheckpointError(f"{path}: rank {r} needs a file and a list of shards")
        out.append(FileRankSource(os.path.join(base, rk["file"]), rk["shards"], r, world, path))
    return out
