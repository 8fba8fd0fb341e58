"""Commit-marker signatures: HMAC-SHA256 with a key shared by publishers and receivers.

With ``DCR_SIGNING_KEY`` (or ``DCR_SIGNING_KEY_FILE``) set, publishers sign every commit marker
and receivers refuse markers that are unsigned or whose signature does not match. A marker binds
its step, attempt, manifest digest (which binds every chunk digest) and policy digest, so a valid
signature covers every byte a receiver applies; a marker copied under another step fails (the step
is signed), and so does any edit of the marker or, through the digests, of what it names.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os

ALGORITHM = "hmac-sha256"
ENV_KEY = "DCR_SIGNING_KEY"
ENV_KEY_FILE = "DCR_SIGNING_KEY_FILE"


def signing_key() -> bytes | None:
    """The configured key, or None when signing is off."""
    path = os.environ.get(ENV_KEY_FILE)
    if path:
        with open(path, "rb") as f:
            key = f.read().strip()
        return key or None
    value = os.environ.get(ENV_KEY)
    return value.encode() if value else None


def _canonical(body: dict) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def sign(key: bytes, body: dict) -> str:
    return hmac.new(key, _canonical(body), hashlib.sha256).hexdigest()


def verify(key: bytes, body: dict, signature: str) -> bool:
    return hmac.compare_digest(sign(key, body), signature)
