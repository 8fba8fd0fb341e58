# The C kernel's signature (_b3runs.c): BLAKE3 hex digests of buffer[starts[i]:starts[i+1]], or of
# prefix || BLAKE3(run) with a prefix. ``buffer`` and ``starts``: any contiguous buffer (starts: int64).
from typing import Any

def runs_hex(buffer: Any, starts: Any, prefix: bytes | None = None) -> tuple[str, ...]: ...
