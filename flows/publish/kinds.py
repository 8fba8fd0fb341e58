"""What a checkpoint path holds, decided without importing torch, and where its reader lives.

A ``.safetensors`` file or a sharded HF directory is read as raw bits (``storage.local.safetensors``:
numpy only), so ``dcr publish`` of one never imports torch. DCP directories and layout files (per-rank
files of a sharded trainer) are read through ``flows.publish.dcp`` and ``flows.publish.layout_file``,
which need torch (``torch.load``, conversions); they are found here by name and imported only when a
path is one of them (a table of module paths, as the CLI's command table).
"""

from __future__ import annotations

import importlib
import os

from storage.local.dcp_metadata import is_dcp_dir

LAYOUT_FORMAT = "dcr-shard-layout"

# kind -> (module, function(path, *args) -> list of ShardedSource): read with torch, imported on use
SHARDED_READERS = {
    "dcp": ("flows.publish.dcp", "dcp_sources"),
    "layout": ("flows.publish.layout_file", "layout_sources"),
}


def is_layout_file(path) -> bool:
    """A per-rank layout file (JSON naming its format near the start)."""
    path = os.fspath(path)
    if not (path.endswith(".json") and os.path.isfile(path)):
        return False
    try:
        with open(path, "rb") as f:
            head = f.read(4096)
    except OSError:
        return False
    return LAYOUT_FORMAT.encode() in head


def sharded_kind(path) -> str | None:
    """``"dcp"`` (a torch.distributed.checkpoint directory), ``"layout"`` (a layout file) or None
    (a canonical checkpoint: a safetensors file or directory)."""
    if is_dcp_dir(path):
        return "dcp"
    if is_layout_file(path):
        return "layout"
    return None


def sharded_sources(kind: str, path, *args) -> list:
    """The sources of every rank of a sharded checkpoint of ``kind`` (imports its reader: torch)."""
    module, function = SHARDED_READERS[kind]
    return getattr(importlib.import_module(module), function)(path, *args)
