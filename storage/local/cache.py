"""DCR's local cache (``dcr cache ls``, ``dcr cache prune``): what it holds, and a bound on its size.

The cache lives in ``$DCR_CACHE_DIR`` (default ``$XDG_CACHE_HOME/dcr``, else ``~/.cache/dcr``):

- ``<16 hex>/baseline.safetensors``: a publisher's copy of the latest step it committed to one ROOT
  (the key is a hash of the ROOT URL), kept so the next delta needs no download; beside it the
  patch logs of a publish in progress;
- ``receivers/<16 hex>/<receiver id>.safetensors``: the mirror of a live-module or vLLM receiver.

Everything here can be rebuilt from its ROOT: an entry that is gone costs the next publish (or
receive) one rebuild, never a wrong bit. Each entry's header says which ROOT and step it holds.

``prune`` deletes entries, least recently used first, until the cache is at most ``max_bytes``;
entries whose ROOT is a local directory that no longer exists go first, whatever the bound. An
entry in use (a publisher encoding against it holds a shared lock; a receiver its state lock) is
skipped. A publisher prunes to ``DCR_CACHE_MAX_BYTES`` (default ``DEFAULT_MAX_BYTES``) after it
writes its baseline, never evicting the one it just wrote.
"""

from __future__ import annotations

import contextlib
import fcntl
import math
import os
import re
import time
from dataclasses import dataclass, field

from dcr_core.errors import UsageError
from storage.local import state
from storage.local.safetensors import read_header

DEFAULT_MAX_BYTES = 16 << 30
ENV_MAX_BYTES = "DCR_CACHE_MAX_BYTES"
_KEY = re.compile(r"^[0-9a-f]{16}$")


@dataclass
class Entry:
    path: str  # the directory (a publisher's) or file (a receiver mirror) that goes as one
    kind: str  # "publisher baseline" | "receiver mirror"
    nbytes: int
    last_used: float  # seconds since the epoch: the newest modification in it
    root: str | None = None  # the ROOT its header names
    step: int | None = None
    orphan: bool = False  # its ROOT is a local directory that no longer exists


@dataclass
class PruneReport:
    cache_dir: str
    max_bytes: int
    before: int
    after: int
    removed: list[dict] = field(default_factory=list)  # {"path", "nbytes", "why"}
    skipped: list[str] = field(default_factory=list)  # in use


def max_bytes_setting() -> int:
    """``DCR_CACHE_MAX_BYTES`` (bytes, or with a K/M/G/T suffix), else ``DEFAULT_MAX_BYTES``."""
    raw = os.environ.get(ENV_MAX_BYTES)
    return DEFAULT_MAX_BYTES if raw is None or not raw.strip() else parse_size(raw, ENV_MAX_BYTES)


def parse_size(text: str, what: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)i?B?\s*", str(text), re.IGNORECASE)
    size = float(m.group(1)) * 1024 ** " KMGT".index(m.group(2).upper() or " ") if m else math.inf
    if not math.isfinite(size):  # not a size, or digits beyond a float's range
        raise UsageError(f"{what}={text!r} is not a size (bytes, or a number with K, M, G or T)")
    return int(size)


def _size_and_use(path: str) -> tuple[int, float]:
    files = [path] if os.path.isfile(path) else [os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs]
    size, used = 0, 0.0
    for f in files:
        with contextlib.suppress(FileNotFoundError):
            st = os.stat(f)
            size += st.st_size
            used = max(used, st.st_mtime)  # each publish and receive rewrites or patches its entry (atime: our own reads)
    return size, used


def _header(path: str) -> tuple[str | None, int | None]:
    try:  # the metadata only: checking every tensor's entry costs a second per 70,000 tensors
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            meta = read_header(path, fd).doc.get("__metadata__") or {}
        finally:
            os.close(fd)
        return meta.get(state.ROOT), int(meta[state.STEP]) if str(meta.get(state.STEP, "")).isdigit() else None
    except Exception:  # noqa: BLE001 - an unreadable entry is listed without its ROOT (and pruned first by age)
        return None, None


def _orphan(root: str | None) -> bool:
    return root is not None and "://" not in root and not os.path.isdir(root)


def entries(cache_dir: str) -> list[Entry]:
    """Every entry of the cache in ``cache_dir``, largest first."""
    found: list[Entry] = []
    with contextlib.suppress(FileNotFoundError):
        for name in os.listdir(cache_dir):
            d = os.path.join(cache_dir, name)
            if _KEY.match(name) and os.path.isdir(d):
                size, used = _size_and_use(d)
                root, step = _header(os.path.join(d, "baseline.safetensors"))
                found.append(Entry(d, "publisher baseline", size, used, root, step, _orphan(root)))
    receivers = os.path.join(cache_dir, "receivers")
    with contextlib.suppress(FileNotFoundError):
        for key in os.listdir(receivers):
            d = os.path.join(receivers, key)
            if not (_KEY.match(key) and os.path.isdir(d)):
                continue
            for f in os.listdir(d):
                if f.endswith(".safetensors") and not f.startswith("."):
                    path = os.path.join(d, f)
                    size, used = _size_and_use(path)
                    root, step = _header(path)
                    found.append(Entry(path, "receiver mirror", size, used, root, step, _orphan(root)))
    return sorted(found, key=lambda e: -e.nbytes)


# a publisher's entry holding a temp file this young, or no baseline yet and files this young, is
# being written (a first publish, or a baseline copied whole): not pruned
WRITING_GRACE_S = 3600.0


@contextlib.contextmanager
def _unused(entry: Entry):
    """Yield whether ``entry`` is free to delete (no publisher or receiver holds it); held meanwhile:
    a receiver mirror's state lock (``storage.local.state.exclusive``, taken without waiting: a
    receive that starts meanwhile waits, then finds the file gone and rebuilds it), and the file's
    own lock (a publisher encoding against its baseline holds it shared)."""
    publisher = entry.kind == "publisher baseline"
    if publisher and _being_written(entry.path):
        yield False
        return
    target = os.path.join(entry.path, "baseline.safetensors") if publisher else entry.path
    with contextlib.ExitStack() as held:
        if not publisher:
            try:
                held.enter_context(state.exclusive(target, wait=False))
            except BlockingIOError:
                yield False
                return
        try:
            f = held.enter_context(open(target, "rb"))
        except FileNotFoundError:
            yield True
            return
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            yield False
            return
        yield True


def _being_written(directory: str, now: float | None = None) -> bool:
    now = time.time() if now is None else now
    has_baseline = os.path.exists(os.path.join(directory, "baseline.safetensors"))
    for d, _, fs in os.walk(directory):
        for f in fs:
            try:
                age = now - os.stat(os.path.join(d, f)).st_mtime
            except FileNotFoundError:
                continue
            if age < WRITING_GRACE_S and (".tmp-" in f or not has_baseline):
                return True
    return False


def _remove(entry: Entry) -> None:
    if os.path.isdir(entry.path):
        for d, _, fs in os.walk(entry.path, topdown=False):
            for f in fs:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(d, f))
            with contextlib.suppress(OSError):
                os.rmdir(d)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(entry.path)
        sidecars = os.path.join(os.path.dirname(entry.path), f".{os.path.basename(entry.path)}.")
        for f in os.listdir(os.path.dirname(entry.path)):
            if os.path.join(os.path.dirname(entry.path), f).startswith(sidecars):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(os.path.dirname(entry.path), f))


def prune(cache_dir: str, max_bytes: int | None = None, keep: str | None = None, dry_run: bool = False) -> PruneReport:
    """Delete entries of the cache in ``cache_dir`` until it holds at most ``max_bytes`` (default:
    ``max_bytes_setting``): orphans first, then the least recently used; never ``keep`` (a path in
    an entry), nor one in use."""
    bound = max_bytes_setting() if max_bytes is None else max_bytes
    if bound < 0:
        raise UsageError(f"the cache bound must be at least 0 bytes, got {bound}")
    found = entries(cache_dir)
    total = sum(e.nbytes for e in found)
    report = PruneReport(cache_dir, bound, total, total)
    order = sorted(found, key=lambda e: (not e.orphan, e.last_used))
    for e in order:
        if keep is not None and os.path.realpath(keep).startswith(os.path.realpath(e.path)):
            continue
        if not e.orphan and report.after <= bound:
            continue
        with _unused(e) as free:
            if not free:
                report.skipped.append(e.path)
                continue
            if not dry_run:
                _remove(e)
        why = f"its ROOT {e.root} no longer exists" if e.orphan else \
            f"least recently used ({time.strftime('%Y-%m-%d %H:%M', time.localtime(e.last_used))})"
        report.removed.append({"path": e.path, "nbytes": e.nbytes, "why": why})
        report.after -= e.nbytes
    return report
