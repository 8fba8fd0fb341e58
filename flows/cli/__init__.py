"""The ``dcr`` command line.

Commands are found by name and their modules imported only when used (a table of module paths,
as pip does): ``dcr ls`` never imports torch or Prefect. Extra commands (``dcr bench``, ``dcr demo``,
from the ``dcr-bench`` package) plug in through the ``dcr.commands`` entry point group: each entry
is a ``main(argv) -> int``.

Errors print one line (``dcr: error: ...``) and exit with the error's code (``dcr_core.errors``);
``DCR_DEBUG=1`` shows tracebacks. Usage errors are one line too (``Parser``), exit 2; Ctrl-C
is one line and exit 130 at any moment, also while a command's modules are still being imported.
"""

from __future__ import annotations

import argparse
import gc as collector  # not "gc": the name of the dcr gc command's module in this package
import importlib
import logging
import os
import sys
import time
from typing import NoReturn

from dcr_core import events
from dcr_core.errors import DCRError
from dcr_core.text import printable

# name -> (module defining add_arguments(name, parser) and run(name, args) -> int, one-line help)
COMMANDS = {
    "publish": ("flows.cli.publish", "publish a checkpoint as step N (keyframe or delta)"),
    "receive": ("flows.cli.receive", "bring a receiver's state file to step N (default latest)"),
    "materialize": ("flows.cli.receive", "write the full checkpoint of step N"),
    "verify-state": ("flows.cli.state", "hash a receiver's state file against the step it holds (and refresh its block digests)"),
    "ls": ("flows.cli.bucket", "one row per step"),
    "verify": ("flows.cli.bucket", "re-read stored payloads and check their digests"),
    "show": ("flows.cli.bucket", "one step, tensor by tensor: encoding, changed elements, bytes, chunks, digests"),
    "status": ("flows.cli.bucket", "where each receiver is, its lag behind the latest step, and how it got there"),
    "report": ("flows.cli.report", "a static HTML page (and PNGs) of the run: bytes, change rate, receivers' lag"),
    "gc": ("flows.cli.gc", "delete steps and attempts that retention no longer needs"),
    "serve": ("flows.cli.serve", "serve the Prefect deployments of infra/prefect.yaml from this process"),
    "mirror": ("flows.cli.mirror", "copy committed steps from ROOT to another ROOT (a relay tree): payload first, marker last"),
    "keygen": ("flows.cli.keys", "write an Ed25519 key pair for signed commits: PATH (private), PATH.pub (public)"),
    "retract": ("flows.cli.retract", "take back step N and every step built on it (a signed retraction record each)"),
    "heartbeat": ("flows.cli.heartbeat", "renew the run's signed heartbeat (receivers with --max-staleness check it)"),
    "fleet": ("flows.cli.fleet", "switch a fleet of vLLM servers to one step, all or nothing (fleets/NAME.json records it)"),
    "cache": ("flows.cli.cache", "the local cache (publishers' baselines, receiver mirrors): ls, or prune to a bound"),
}
PLUGIN_GROUP = "dcr.commands"


class Parser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` whose usage errors (an unknown command or option, a missing
    argument, a bad value) are one line naming the command, with where to read more, and exit 2:
    ``dcr receive: error: argument --interval: expected ... (dcr receive --help)``. Its commands (its
    subparsers, of this class too) refuse an argument they do not know themselves, so the line names them."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {printable(message)} ({self.prog} --help)\n")

    def parse_known_args(self, args=None, namespace=None):
        parsed, extra = super().parse_known_args(args, namespace)
        if extra:
            self.error(f"unrecognized arguments: {' '.join(extra)}")
        return parsed, extra


def plugins() -> dict:
    from importlib.metadata import entry_points  # noqa: PLC0415 - reads every distribution's metadata: only when listed

    return {ep.name: ep for ep in entry_points(group=PLUGIN_GROUP) if ep.name not in COMMANDS}


def build_parser(command: str | None = None) -> Parser:
    """The parser, with the arguments of ``command`` (the others only listed: nothing imported).
    The plugins are listed only when no built-in command is given (``dcr --help``, a typo): finding
    them reads the metadata of every installed distribution."""
    parser = Parser(prog="dcr", description="Bit-exact delta-compressed refit through object storage.")
    parser.add_argument("--version", action="store_true", help="print the versions of dcr and dcr-zarr-codec, and exit")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == command:
            events.reached("cli.importing", command=name)  # the slow part of a start (torch, say)
            importlib.import_module(module).add_arguments(name, p)
    for name, ep in sorted(plugins().items() if command not in COMMANDS else ()):
        sub.add_parser(name, help=f"(from {ep.dist.name if ep.dist else 'a plugin'}) see dcr {name} --help", add_help=False)
    return parser


def _return_freed_memory_to_the_os() -> None:
    """Make glibc serve large buffers with mmap (and give them back on free).

    DCR allocates and frees one tensor-sized buffer after another. glibc's default raises its mmap
    threshold after the first large free, and later tensor buffers then come from the heap, which
    is not returned to the OS: resident memory grows toward the model size although DCR holds one
    tensor at a time. A fixed threshold keeps resident memory at what is actually held. It is 8 MiB,
    above the 4 MiB default chunk: chunk-sized buffers (XOR masks, planes, decoded payloads) are
    reused from the heap instead of being mapped and faulted in afresh each time, which doubled the
    codec's throughput against a 1 MiB threshold (``dcr bench``, 100M BF16 at 5-10% changed) for
    about 7 MiB more resident memory (``tests/system/test_memory.py``). The heap's trim threshold
    is raised from 128 KiB to 32 MiB for the same reason: with the default, freeing one chunk-sized
    buffer at the top of the heap hands it back to the OS, and the next chunk faults it in again
    (a fresh 4 MiB buffer cost 0.9 ms to touch here, against 0.05 ms reused: about half of a
    chunk's encode or decode); at most 32 MiB of freed heap stays resident.
    """
    if not sys.platform.startswith("linux"):
        return
    import ctypes  # noqa: PLC0415 - only on Linux

    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 8 << 20)  # M_MMAP_THRESHOLD
        libc.mallopt(-1, 32 << 20)  # M_TRIM_THRESHOLD
    except (OSError, AttributeError):
        pass  # not glibc: its allocator returns memory its own way


def versions() -> str:
    """``dcr --version``: this command's version and the codec package's (what a bug report needs:
    a stored array's codec is read by the codec package, which installs on its own)."""
    from importlib.metadata import PackageNotFoundError, version  # noqa: PLC0415 - only for --version

    def of(dist: str) -> str:
        try:
            return version(dist)
        except PackageNotFoundError:
            return "not installed"

    return f"dcr {of('dcr')} (dcr-zarr-codec {of('dcr-zarr-codec')}, Python {sys.version.split()[0]})"


class PrintableRecords(logging.Filter):
    """Log records (warnings a command prints on stderr) with their control characters escaped:
    they quote names and messages from the bucket (``dcr_core.text``)."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.msg, record.args = printable(record.getMessage()), None
        return True


def command() -> int:
    """The ``dcr`` executable (and ``python -m flows.cli``): ``main``, then the process ends.

    What importing the command built (modules, classes, the parser) is frozen out of the cyclic
    collector before the command runs (``gc.freeze``): the collections that tens of thousands of
    tensors' objects trigger then walk only those, not the 55,000 of the imports again each time
    (about 0.015 s of a 15,000-tensor publish). Everything the command built is frozen too before
    the process ends: the interpreter's last collections at exit would otherwise walk it all once
    more, 0.05-0.13 s after a publish or receive of 15,000 tensors had printed its result. Nothing
    DCR holds needs the collector to be released (files are closed where they were opened, and exit
    handlers still run). In-process callers use ``main``, which freezes nothing."""
    global _FREEZE_IMPORTS
    _FREEZE_IMPORTS = True
    rc = main()
    collector.freeze()
    return rc


_FREEZE_IMPORTS = False  # the console script: what importing built is frozen before the command runs


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(list(sys.argv[1:] if argv is None else argv))
    except KeyboardInterrupt:  # Ctrl-C, from the first import on: one line, as every other way a command ends
        print("dcr: interrupted", file=sys.stderr)
        return 130


def _collect_garbage_less_often() -> None:
    """Make the cyclic garbage collector's passes rarer. A step of tens of thousands of tensors puts
    hundreds of thousands of small objects in memory at once (manifest columns, safetensors
    headers); with the default thresholds the collector walks them all again and again while they
    are built, about 0.1 s of a 15,000-tensor receive here. What DCR builds is acyclic and freed by
    reference counting the moment it is dropped; the collector is still there for cycles, later."""
    collector.set_threshold(10_000, 20, 100)


def _main(argv: list[str]) -> int:
    _return_freed_memory_to_the_os()
    _collect_garbage_less_often()
    if logging.lastResort is not None and not any(isinstance(f, PrintableRecords) for f in logging.lastResort.filters):
        logging.lastResort.addFilter(PrintableRecords())  # what prints a command's warnings
    if argv[:1] == ["--version"]:
        print(versions())
        return 0
    command = argv[0] if argv else None
    extra = plugins().get(command) if command not in COMMANDS else None
    if extra is not None:
        return extra.load()(argv[1:])
    try:
        args = build_parser(command if command in COMMANDS else None).parse_args(argv)
    except SystemExit as e:  # a usage error (its line printed) or --help: the code, for callers in this process
        return int(e.code or 0)
    if _FREEZE_IMPORTS:
        collector.freeze()
    t0 = time.perf_counter()
    try:
        return importlib.import_module(COMMANDS[args.command][0]).run(args.command, args)
    except DCRError as e:
        print(f"dcr: error: {printable(e)}", file=sys.stderr)
        return e.exit_code
    except Exception as e:  # anything unexpected: still one line, unless debugging
        if os.environ.get("DCR_DEBUG"):
            raise
        first = str(e).splitlines()[0] if str(e) else ""
        print(f"dcr: error: {type(e).__name__}: {printable(first)}", file=sys.stderr)
        return 1
    finally:
        if os.environ.get("DCR_TIMING"):
            print(f"dcr: {args.command} took {time.perf_counter() - t0:.3f} s", file=sys.stderr)
