"""``dcr publish ROOT CHECKPOINT --step N [--keyframe]``."""

from __future__ import annotations

import sys
from dataclasses import asdict

from dcr_core.errors import UsageError
from dcr_core.retention import KeyframePolicy
from flows.cli.common import (
    add_common,
    add_workers,
    default_text,
    from_model,
    model_default,
    say,
    step_arg,
    storage_options,
    use_prefect,
)
from flows.cli.progress import shown
from flows.cli.values import Number
from flows.options import DELTA_CODECS, PublishOptions
from flows.publish.pipeline import run_publish
from flows.publish.sources import sharded_kind, sharded_sources
from flows.workers import parse_workers


def add_arguments(name: str, p) -> None:
    add_common(p, orchestrated=True)
    p.add_argument("checkpoint", help="a .safetensors file, a sharded HF directory, a DCP directory or a layout file")
    p.add_argument("--step", type=step_arg, required=True, metavar="N",
                   help="the step to commit: greater than the latest committed step (usually the trainer's step)")
    p.add_argument("--keyframe", action="store_true", help="store a full snapshot and start a new lineage")
    p.add_argument(
        "--dcp-prefix", default=None, metavar="PREFIX",
        help="CHECKPOINT is a torch.distributed.checkpoint directory: publish only tensors named PREFIX..., "
        "without the prefix (e.g. model.)",
    )
    p.add_argument("--chunk-bytes", type=Number(int, 1, 1 << 30),
                   **from_model(PublishOptions, "chunk_bytes", help="raw bytes per chunk, at most 1 GiB"))
    p.add_argument("--pack-bytes", type=Number(int, 0, 1 << 30), metavar="B", **from_model(
        PublishOptions, "pack_bytes", help="stored chunks go into shared pack objects of at least B bytes, so a step "
        "costs about one object per B stored however many tensors it holds; 0: one object per chunk and a zarr.json "
        "per array (the layout before packs, which any zarr opens without dcr-zarr-codec)"))
    p.add_argument("--bundle-below", type=Number(int, 0, 1 << 30), metavar="B", **from_model(
        PublishOptions, "bundle_below", help="a keyframe stores tensors smaller than B bytes in bundles (one flat "
        "tensor per dtype, its members named in the manifest), so a step of tens of thousands of small tensors costs "
        "about what its bytes in a few tensors cost; its deltas keep its bundles; 0: never"))
    p.add_argument("--bundle-min-tensors", type=Number(int, 2, 1 << 30), metavar="N", **from_model(
        PublishOptions, "bundle_min_tensors", help="bundle a dtype's small tensors only when it holds at least N of them"))
    p.add_argument("--column-blocks", type=Number(int, 1, 1024), metavar="N", **from_model(
        PublishOptions, "column_blocks", help="tile tensors larger than a chunk into N column blocks of their last dim "
        "(where N divides it) and at least N row blocks, so tensor-parallel receiver ranks (TP dividing N) pull only "
        "their own slices; 1: contiguous chunks"))
    p.add_argument("--no-cache", action="store_true", help="rebuild the baseline from ROOT instead of the local cache")
    policy = model_default(PublishOptions, "keyframe_policy")
    p.add_argument(
        "--keyframe-every", type=Number(int, 0), default=policy.every, metavar="K",
        help="keyframe policy: make this step a restart point once K steps passed since the lineage's keyframe "
        f"(default {policy.every}: never)",
    )
    p.add_argument(
        "--keyframe-above", type=Number(float, 0), default=policy.above, metavar="F",
        help="keyframe policy: make this step a restart point once the stored delta bytes since the lineage's "
        f"keyframe exceed F times the full size, e.g. 0.5 (default {default_text(policy.above)}: never)",
    )
    add_workers(p, "encode (the workers read CHECKPOINT)")
    codec = default_codec()
    p.add_argument(
        "--codec", choices=tuple(DELTA_CODECS), default=codec,
        help="delta codec: sparse (near the entropy bound; stock zarr reads it with this package installed), cond "
        "(coded against the receiver's old bits: about 0.7x sparse's bytes on optimizer steps; receivers decode it, "
        f"stock zarr cannot) or blosc (standard Zarr codec only, about 1.6x the bytes); default {codec}",
    )


def default_codec() -> str:
    """The ``--codec`` choice of ``PublishOptions``' default delta codec."""
    default = model_default(PublishOptions, "delta_codec")
    return next(name for name, spec in DELTA_CODECS.items() if spec == default)


def _source(args):
    """What to publish: a checkpoint path as it is (read as bits: torch is never imported for it), or
    the ranks of a sharded checkpoint (their readers import torch)."""
    kind = sharded_kind(args.checkpoint)
    if kind == "dcp":  # a DCP directory: published from its shards, file by file
        return sharded_sources(kind, args.checkpoint, args.dcp_prefix)
    if kind == "layout":  # per-rank safetensors files + a layout file
        return sharded_sources(kind, args.checkpoint)
    if args.dcp_prefix is not None:
        raise UsageError(f"{args.checkpoint}: --dcp-prefix needs a torch.distributed.checkpoint directory (with .metadata)")
    return args.checkpoint


def publish_options(args) -> PublishOptions:
    return PublishOptions(
        io_workers=args.io_workers, use_cache=not args.no_cache, delta_codec=DELTA_CODECS[args.codec],
        keyframe_policy=KeyframePolicy(every=args.keyframe_every, above=args.keyframe_above),
        chunk_bytes=args.chunk_bytes, pack_bytes=args.pack_bytes, bundle_below=args.bundle_below,
        bundle_min_tensors=args.bundle_min_tensors, column_blocks=args.column_blocks,
    )


def run(name: str, args) -> int:
    so = storage_options(args)
    options = publish_options(args)
    source = _source(args)
    with shown(args, f"publish step {args.step}"):
        res = _publish(args, source, so, options)
    s = res["summary"]
    base = "" if res["base_step"] is None else f" against step {res['base_step']}"
    if res["kind"] == "keyframe" and s.get("keyframe_reason") not in (None, "requested", "first step"):
        base = f" by keyframe policy: {s['keyframe_reason']}"
    if res["kind"] == "delta" and s.get("tensors_changed") == 0 and not args.quiet and not args.json:
        print(f"dcr: publish: note: the checkpoint is bit-identical to step {res['base_step']}; step {res['step']} "
              "changes nothing (receivers move to it without pulling a chunk)", file=sys.stderr)
    say(
        args,
        f"committed step {res['step']} ({res['kind']}{base}): {s['tensors_changed']}/{s['tensors']} tensors changed, "
        f"change rate {100 * s['change_rate']:.3f}%, stored {s['bytes_stored']} of {s['bytes_full']} bytes",
        res,
    )
    return 0


def _publish(args, source, so, options) -> dict:
    workers = parse_workers(args.workers)
    if workers is not None and not isinstance(source, str):
        raise UsageError(f"{args.checkpoint}: --workers publishes a canonical checkpoint file; a sharded checkpoint "
                         "is published by its own ranks")
    if use_prefect(args) or workers is not None:
        from flows.cli.orchestrated import run_flow  # noqa: PLC0415 - Prefect only when asked for

        return run_flow(args, "publish_refit", args.root, source, args.step, args.keyframe, so, options,
                        workers=args.workers)
    return asdict(run_publish(args.root, source, args.step, args.keyframe, so, options))
