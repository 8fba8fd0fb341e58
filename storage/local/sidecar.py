"""The block digests of a held state file (``.<name>.blocks`` beside it).

A manifest of schema 2 builds every tensor digest over block digests (``dcr_core.digest``). An
in-place refit that knows the block digests of the state it holds re-hashes only the blocks the
refit changes, and still proves every new tensor against the target step's digest: the unchanged
blocks' digests come from here. So this file is trusted only as far as the policy below allows.
Digests are kept per tensor the step stores: a bundle (``dcr_core.bundles``) under its own name,
over its members' bits back to back (one run of the state file), and only once every member was
checked against its own digest (so a refit that leaves a bundle unchanged need not hash it again).

Trust policy (``load``): the sidecar is used for a refit only when
- it is whole (a BLAKE3 trailer over the rest) and names the step, policy digest and block size of
  the held state and of the refit's manifests;
- the state file is the one it describes: the same device, inode, size, modification time and
  change time (nanoseconds) as right after DCR last wrote it. Every write through the file system
  (``write``, ``mmap``, ``truncate``) and every ``utime`` that puts an old modification time back
  sets the change time to now, which no unprivileged call can undo;
- no journal was settled by this receive (a crash, a cut-off patch, a power loss: the caller removes
  the sidecar, so the next refit hashes everything and writes a new one);
- a sample of blocks not otherwise hashed (``SAMPLE_BLOCKS`` per refit, chosen at random across the
  whole state) hash to their recorded digests: a bit flip below the file system (a disk, a bad
  DIMM), which no time stamp shows, is found with probability ``SAMPLE_BLOCKS * k / blocks`` per
  refit for ``k`` damaged blocks, and always by ``dcr verify-state``, which hashes every block.

When any check fails, the refit hashes every tensor, as without a sidecar: a held state that does
not match its step is then refused, naming the tensor. The sidecar is written after the patch is
in the page cache and before the patch commits, through a temp file and a rename; it is not
fsynced: a sidecar lost or torn by a power loss fails its trailer or names another step, and costs
one refit that hashes everything.

Layout: ``DCRBLKS1``, u64 length of a JSON head (step, policy digest, block size, the file's stamp,
and per tensor its name and number of blocks, in name order), the head, every block digest (32 bytes
each, tensors in name order), then a 32-byte BLAKE3 of everything before it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import struct
import uuid
from dataclasses import dataclass

import blake3
import numpy as np

from dcr_core.digest import LEAF_BYTES

log = logging.getLogger("dcr.receive")
MAGIC = b"DCRBLKS1"
SAMPLE_BLOCKS = 8
MAX_HEAD_BYTES = 256 << 20


def sidecar_path(state_path: str) -> str:
    directory, name = os.path.split(os.path.realpath(state_path))
    return os.path.join(directory, f".{name}.blocks")


def stamp(state_path: str) -> list[int]:
    """What identifies the bytes of ``state_path`` as DCR last wrote them (see the module doc)."""
    st = os.stat(state_path)
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


@dataclass
class Sidecar:
    step: int
    policy_digest: str
    block_bytes: int
    leaves: dict[str, np.ndarray]  # name -> (blocks, 32) uint8
    stamp: list[int] | None = None

    def to_bytes(self) -> bytes:
        names = sorted(self.leaves)
        head = json.dumps({
            "step": self.step, "policy_digest": self.policy_digest, "block_bytes": self.block_bytes,
            "stamp": self.stamp, "tensors": [[n, int(self.leaves[n].shape[0])] for n in names],
        }).encode()
        body = b"".join([MAGIC, struct.pack("<Q", len(head)), head]
                        + [np.ascontiguousarray(self.leaves[n], np.uint8).tobytes() for n in names])
        return body + blake3.blake3(body).digest()

    @classmethod
    def from_bytes(cls, data: bytes) -> Sidecar | None:
        """The sidecar in ``data``, or None when it is torn, damaged or not one."""
        if len(data) < len(MAGIC) + 8 + LEAF_BYTES or data[: len(MAGIC)] != MAGIC:
            return None
        if blake3.blake3(memoryview(data)[:-LEAF_BYTES]).digest() != data[-LEAF_BYTES:]:
            return None
        (n,) = struct.unpack_from("<Q", data, len(MAGIC))
        at = len(MAGIC) + 8
        try:
            if n > MAX_HEAD_BYTES:
                return None
            head = json.loads(data[at : at + n])
            if not isinstance(head, dict):
                return None
            at += n
            leaves = {}
            for name, count in head["tensors"]:
                size = int(count) * LEAF_BYTES
                leaves[str(name)] = np.frombuffer(data, np.uint8, size, at).reshape(-1, LEAF_BYTES)
                at += size
            if at != len(data) - LEAF_BYTES:
                return None
            return cls(int(head["step"]), str(head["policy_digest"]), int(head["block_bytes"]), leaves,
                       head.get("stamp"))
        except (ValueError, TypeError, KeyError):
            return None


def write(state_path: str, sidecar: Sidecar) -> None:
    """Stamp ``sidecar`` with the state file as it is now and put it beside it (temp file, rename)."""
    sidecar.stamp = stamp(state_path)
    tmp = stage(state_path, sidecar)
    try:
        os.replace(tmp, sidecar_path(state_path))
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def remove(state_path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(sidecar_path(state_path))


def read(state_path: str) -> Sidecar | None:
    """The sidecar beside ``state_path`` whatever it describes; None when absent, torn or damaged."""
    try:
        with open(sidecar_path(state_path), "rb") as f:
            return Sidecar.from_bytes(f.read())
    except FileNotFoundError:
        return None


def load(state_path: str, step: int, policy_digest: str, block_bytes: int) -> Sidecar | None:
    """The sidecar of ``state_path`` if it describes the file as it is (step, policy, block size,
    stamp; see the module doc), else None. The sampled blocks are the caller's (``sample``)."""
    s = read(state_path)
    if s is None or (s.step, s.policy_digest, s.block_bytes) != (step, policy_digest, block_bytes):
        return None
    return s if s.stamp == stamp(state_path) else None


def sample(sidecar: Sidecar, sizes: dict[str, int], k: int | None = None,
           rng: random.Random | None = None) -> list[tuple[str, int]]:
    """``k`` blocks ``(tensor, block)`` drawn at random, each block equally likely, from tensors of
    ``sizes`` (name -> bytes) whose recorded block count matches their size; fewer if there are fewer."""
    rng = rng or random.SystemRandom()
    k = SAMPLE_BLOCKS if k is None else k
    counts = [(n, -(-sizes[n] // sidecar.block_bytes)) for n in sorted(sizes) if n in sidecar.leaves]
    counts = [(n, c) for n, c in counts if c and sidecar.leaves[n].shape[0] == c]
    total = sum(c for _, c in counts)
    picks = sorted(rng.sample(range(total), min(k, total))) if total else []
    out, at, i = [], 0, 0
    for name, c in counts:
        while i < len(picks) and picks[i] < at + c:
            out.append((name, picks[i] - at))
            i += 1
        at += c
    return out


def stage(state_path: str, sidecar: Sidecar) -> str:
    """Write ``sidecar`` (not yet stamped) under a temp name beside the state (removed by the
    state's lock if a crash leaves it); ``install`` stamps it and puts it in place."""
    directory, name = os.path.split(os.path.realpath(state_path))
    tmp = os.path.join(directory, f".{name}.tmp-blocks-{uuid.uuid4().hex}")
    with open(tmp, "wb") as f:
        f.write(sidecar.to_bytes())
    return tmp


def install(state_path: str, staged: str) -> None:
    """Stamp the staged sidecar with the state file as it is now and put it in place. Best effort:
    a sidecar that cannot be written only costs the next refit a full hash (never the refit)."""
    try:
        with open(staged, "rb") as f:
            s = Sidecar.from_bytes(f.read())
        os.unlink(staged)
        if s is not None:
            write(state_path, s)
    except OSError as e:
        log.warning("%s: cannot keep its block digests (%s); the next refit hashes every block", state_path, e)
        remove(state_path)


def keep(state_path: str, sidecar: Sidecar) -> None:
    """``write``, best effort (as ``install``)."""
    try:
        write(state_path, sidecar)
    except OSError as e:
        log.warning("%s: cannot keep its block digests (%s); the next refit hashes every block", state_path, e)
