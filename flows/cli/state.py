"""``dcr verify-state PATH [--root ROOT]``: hash a receiver's state file against its step."""

from __future__ import annotations

import dataclasses
import time

from dcr_core.text import plural
from flows.cli.common import say
from flows.receive.verify_state import verify_state
from storage.root import parse_storage_options


def add_arguments(name: str, p) -> None:
    p.add_argument("path", metavar="PATH", help="the receiver's .safetensors state file")
    p.add_argument("--root", default=None, metavar="ROOT",
                   help="the ROOT to read the step's manifest from (default: the one the file's header records)")
    p.add_argument("--storage-option", action="append", default=[], metavar="KEY=VALUE",
                   help="extra fsspec option for the ROOT (repeatable)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("-q", "--quiet", action="store_true", help="print nothing on success")


def run(name: str, args) -> int:
    t0 = time.perf_counter()
    res = verify_state(args.path, args.root, parse_storage_options(args.storage_option))
    seconds = time.perf_counter() - t0
    kept = {"agreed": "its block digests agreed", "absent": "no usable block digests were kept",
            "differed": f"{plural(res.stale_blocks, 'kept block digest')} differed"}[res.sidecar]
    checked = f"{plural(res.tensors, 'tensor')} ({plural(res.nbytes, 'byte')})"
    say(args, f"{res.path}: step {res.step} of {res.root}, {checked} verified in "
              f"{seconds:.2f} s; {kept}" + ("; block digests rewritten" if res.blocks else ""),
        dataclasses.asdict(res) | {"seconds": seconds})
    return 0
