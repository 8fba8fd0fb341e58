# The C kernel's signature (_b3runs.c): BLAKE3 hex digests of buffer[starts[i]:starts[i+1]], or of
# prefix || BLAKE3(run) with a prefix. ``buffer`` and ``starts``: any contiguous buffer (starts: int64).
# ``rows_hex``: the BLAKE3 hex digest of a policy digest's text (dcr_core.digest.policy_digest) of
# (name, dtype, shape, digest) rows, or None for rows it does not take as they are.
from typing import Any

def runs_hex(buffer: Any, starts: Any, prefix: bytes | None = None) -> tuple[str, ...]: ...
def rows_hex(rows: Any) -> str | None: ...
