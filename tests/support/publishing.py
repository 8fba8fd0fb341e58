"""Test checkpoints published as steps, in-process (``publish_steps``) or by ``dcr publish``
(``publish_file``); the baseline file a publisher keeps."""

from __future__ import annotations

import glob
import os
from collections.abc import Mapping, Sequence

import torch

from flows import run_publish
from flows.options import PublishOptions
from flows.publish import baseline
from tests.support.cli import dcr
from tests.support.helpers import write_safetensors


def publish_steps(root: str, checkpoints: Sequence[Mapping[str, torch.Tensor]], first: int = 0, *,
                  cache_dir: str | os.PathLike | None = None, **fields) -> None:
    """Publish ``checkpoints`` in-process as steps ``first``, ``first + 1``, ...; ``fields`` are
    ``PublishOptions``' (the baseline cache under ``cache_dir``; none without it)."""
    cache = {"cache_dir": str(cache_dir)} if cache_dir is not None else {"use_cache": False}
    options = PublishOptions(**cache, **fields)
    for i, ck in enumerate(checkpoints):
        run_publish(root, ck, first + i, options=options)


def publish_file(tmp_path, root, ck: Mapping[str, torch.Tensor], step: int, *flags, check: int | None = 0):
    """``ck`` written to a safetensors file and published by ``dcr publish`` as ``step`` (chunks of
    256 bytes, no baseline cache, then ``flags``); the command's result (``tests.support.cli.dcr``)."""
    p = tmp_path / f"c{step}.safetensors"
    write_safetensors(p, ck)
    return dcr("publish", root, p, "--step", step, "--chunk-bytes", 256, "--no-cache", *flags, check=check)


def baseline_cache_file(cache_dir) -> str:
    """The one baseline file a publisher keeps under ``cache_dir``."""
    (path,) = glob.glob(os.path.join(str(cache_dir), "*", baseline.BASELINE_FILE))
    return path
