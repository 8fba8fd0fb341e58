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

from dcr_core.errors import UsageError

ALGORITHM = "hmac-sha256"
ENV_KEY = "DCR_SIGNING_KEY"
ENV_KEY_FILE = "DCR_SIGNING_KEY_FILE"


def signing_key() -> bytes | None:
    """The configured key, or None when signing is off (neither variable set).

    A key that is set but empty or only whitespace is an error, never "signing off": an empty key
    file must not silently disable the checks (nor override a valid ``DCR_SIGNING_KEY``)."""
    path = os.environ.get(ENV_KEY_FILE)
    if path is not None and not path.strip():
        raise UsageError(f"{ENV_KEY_FILE} is set but empty; set it to the key file's path or unset it")
    if path is not None:
        try:
            with open(path, "rb") as f:
                key = f.read().strip()
        except OSError as e:
            raise UsageError(f"{ENV_KEY_FILE}={path}: cannot read the signing key ({e.strerror or e})") from None
        if not key:
            raise UsageError(f"{ENV_KEY_FILE}={path}: the signing key file is empty; put the key in it or unset the variable")
        return key
    value = os.environ.get(ENV_KEY)
    if value is None:
        return None
    if not value.strip():
        raise UsageError(f"{ENV_KEY} is set but empty; set the key or unset the variable")
    return value.encode()


def _canonical(body: dict) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def sign(key: bytes, body: dict) -> str:
    return hmac.new(key, _canonical(body), hashlib.sha256).hexdigest()


def verify(key: bytes, body: dict, signature: str) -> bool:
    return hmac.compare_digest(sign(key, body), signature)
