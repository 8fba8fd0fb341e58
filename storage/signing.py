"""Commit-marker signatures: HMAC-SHA256 with a shared secret, or Ed25519 with a key pair.

A marker binds its step, attempt, manifest digest (which binds every chunk digest), policy digest
and run, so a valid signature covers every byte a receiver applies; a marker copied under another
step fails (the step is signed), and so does any edit of the marker or, through the digests, of what
it names.

- **HMAC** (one trust domain): ``DCR_SIGNING_KEY`` (the secret) or ``DCR_SIGNING_KEY_FILE`` (a file
  holding it) on publishers and receivers alike.
- **Ed25519** (receivers and mirrors that must not be able to sign): ``dcr keygen PATH`` writes a
  private key to PATH and its public key to PATH.pub (PEM). Publishers point
  ``DCR_SIGNING_KEY_FILE`` at the private key (told apart from an HMAC secret file by its content);
  receivers and mirrors point ``DCR_VERIFY_KEY_FILE`` at the public key.

Publishers sign with the signing key; readers verify with the verify key, or, without one, with the
signing key (HMAC: the secret; Ed25519: its public half). With a key to verify with, a reader
refuses markers that are unsigned, signed with the other algorithm, or whose signature does not
match. A key variable that is set but empty, unreadable or of the wrong kind is an error, never
"signing off".
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
from dataclasses import dataclass

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from dcr_core.errors import UntrustedError, UsageError
from storage.document_fields import fail

HMAC_SHA256 = "hmac-sha256"
ED25519 = "ed25519"
ALGORITHMS = (HMAC_SHA256, ED25519)
ENV_KEY = "DCR_SIGNING_KEY"
ENV_KEY_FILE = "DCR_SIGNING_KEY_FILE"
ENV_VERIFY_KEY_FILE = "DCR_VERIFY_KEY_FILE"
ENV_REQUIRE_SIGNED = "DCR_REQUIRE_SIGNED"  # 1: a reader refuses to read without a key (dcr receive --require-signed)
_PEM_PRIVATE = b"-----BEGIN PRIVATE KEY-----"
_PEM_PUBLIC = b"-----BEGIN PUBLIC KEY-----"


@dataclass(frozen=True)
class Key:
    """A key to sign or verify markers with: an HMAC secret, an Ed25519 private key (signs and
    verifies) or an Ed25519 public key (verifies only). ``source`` names where it came from."""

    algorithm: str
    source: str
    secret: bytes | None = None
    private: Ed25519PrivateKey | None = None
    public: Ed25519PublicKey | None = None

    def sign(self, body: dict) -> str:
        if self.secret is not None:
            return hmac.new(self.secret, _canonical(body), hashlib.sha256).hexdigest()
        if self.private is None:
            raise UsageError(f"{self.source} holds a public key: it verifies markers but cannot sign them")
        return self.private.sign(_canonical(body)).hex()

    def verify(self, body: dict, signature: str) -> bool:
        if self.secret is not None:
            return hmac.compare_digest(self.sign(body), signature)
        try:
            raw = bytes.fromhex(signature)
        except ValueError:
            return False
        try:
            self.ed25519_public().verify(raw, _canonical(body))
        except InvalidSignature:
            return False
        return True

    def ed25519_public(self) -> Ed25519PublicKey:
        """The Ed25519 public key: given, or the half of the private key."""
        if self.public is not None:
            return self.public
        if self.private is not None:
            return self.private.public_key()
        raise UsageError(f"{self.source} is an HMAC secret: it has no public key")

    def verifier(self) -> Key:
        """The key readers need: the same secret, or the public half of a private key."""
        if self.private is None:
            return self
        return Key(ED25519, self.source, public=self.private.public_key())

    @property
    def fingerprint(self) -> str:
        """A short name for the key a reader trusts (Ed25519: SHA-256 of the raw public key)."""
        if self.secret is not None:
            return "hmac:" + hashlib.sha256(b"dcr-hmac-id\0" + self.secret).hexdigest()[:16]
        return "ed25519:" + hashlib.sha256(_raw_public(self.ed25519_public())).hexdigest()[:16]


def signature_field(d: dict, where: str) -> tuple[str | None, str]:
    """A signed document's ``signature`` field as (value, algorithm); (None, HMAC) when unsigned."""
    sig = d.get("signature")
    if sig is None:
        return None, HMAC_SHA256
    if not (isinstance(sig, dict) and sig.get("algorithm") in ALGORITHMS and isinstance(sig.get("value"), str)
            and len(sig["value"]) <= 1024):
        raise fail(where, "malformed signature")
    return sig["value"], sig["algorithm"]


def signed_json(body: dict, signature: str | None, algorithm: str) -> bytes:
    """A signed document's bytes: its body, then its signature (when it has one)."""
    d = dict(body)
    if signature is not None:
        d["signature"] = {"algorithm": algorithm, "value": signature}
    return json.dumps(d, indent=1).encode() + b"\n"


def _raw_public(public: Ed25519PublicKey) -> bytes:
    return public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def _canonical(body: dict) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def _read_key_file(var: str, what: str) -> tuple[str, bytes] | None:
    path = os.environ.get(var)
    if path is None:
        return None
    if not path.strip():
        raise UsageError(f"{var} is set but empty; set it to the key file's path or unset it")
    try:
        with open(path, "rb") as f:
            data = f.read(1 << 16).strip()
    except OSError as e:
        raise UsageError(f"{var}={path}: cannot read the {what} key ({e.strerror or e})") from None
    if not data:
        raise UsageError(f"{var}={path}: the {what} key file is empty; put the key in it or unset the variable")
    return path, data


def _load_private(data: bytes, where: str) -> Ed25519PrivateKey:
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError) as e:
        raise UsageError(f"{where}: not a readable PEM private key ({e})") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise UsageError(f"{where}: a {type(key).__name__}, not an Ed25519 private key (make one with dcr keygen)")
    return key


def _load_public(data: bytes, where: str) -> Ed25519PublicKey:
    try:
        key = serialization.load_pem_public_key(data)
    except (ValueError, TypeError) as e:
        raise UsageError(f"{where}: not a readable PEM public key ({e})") from None
    if not isinstance(key, Ed25519PublicKey):
        raise UsageError(f"{where}: a {type(key).__name__}, not an Ed25519 public key (make one with dcr keygen)")
    return key


def signing_key() -> Key | None:
    """The publisher's key (``DCR_SIGNING_KEY_FILE``, else ``DCR_SIGNING_KEY``), or None when
    signing is off. A public key there is refused: publishers sign with the private key."""
    found = _read_key_file(ENV_KEY_FILE, "signing")
    if found is not None:
        path, data = found
        where = f"{ENV_KEY_FILE}={path}"
        if data.startswith(_PEM_PRIVATE):
            return Key(ED25519, where, private=_load_private(data, where))
        if data.startswith(_PEM_PUBLIC):
            raise UsageError(f"{where} holds a public key; publishers sign with the private key "
                             f"(receivers and mirrors take the public one in {ENV_VERIFY_KEY_FILE})")
        return Key(HMAC_SHA256, where, secret=data)
    value = os.environ.get(ENV_KEY)
    if value is None:
        return None
    if not value.strip():
        raise UsageError(f"{ENV_KEY} is set but empty; set the key or unset the variable")
    return Key(HMAC_SHA256, ENV_KEY, secret=value.encode())


def publisher_key() -> Key | None:
    """``signing_key()``, refusing a publisher that is told to expect Ed25519 signatures
    (``DCR_VERIFY_KEY_FILE``) but has nothing to sign with: its steps would be refused."""
    key = signing_key()
    if key is None and os.environ.get(ENV_VERIFY_KEY_FILE) is not None:
        raise UsageError(f"{ENV_VERIFY_KEY_FILE} is set but no signing key: a publisher signs with the private key "
                         f"({ENV_KEY_FILE}=PATH of dcr keygen PATH)")
    return key


def verify_key() -> Key | None:
    """The reader's key: ``DCR_VERIFY_KEY_FILE`` (an Ed25519 public key), else the signing key's
    verifying half; None when neither is set (markers are then read unsigned or not)."""
    found = _read_key_file(ENV_VERIFY_KEY_FILE, "verify")
    if found is None:
        key = signing_key()
        return None if key is None else key.verifier()
    path, data = found
    where = f"{ENV_VERIFY_KEY_FILE}={path}"
    if data.startswith(_PEM_PRIVATE):
        raise UsageError(f"{where} holds a private key; give receivers and mirrors the public key (PATH.pub)")
    if not data.startswith(_PEM_PUBLIC):
        raise UsageError(f"{where}: not an Ed25519 public key in PEM (an HMAC secret goes in {ENV_KEY_FILE})")
    key = Key(ED25519, where, public=_load_public(data, where))
    signer = signing_key()
    if signer is not None and signer.fingerprint != key.fingerprint:
        raise UsageError(f"{where} and {signer.source} are not one key pair; unset one of them")
    return key


def require_signed() -> bool:
    """Whether readers must verify every marker (``DCR_REQUIRE_SIGNED=1``): with no key to verify
    with, they refuse to read at all instead of reading unsigned or unchecked steps."""
    value = os.environ.get(ENV_REQUIRE_SIGNED, "").strip().lower()
    if value in ("", "0", "false", "no"):
        return False
    if value in ("1", "true", "yes"):
        return True
    raise UsageError(f"{ENV_REQUIRE_SIGNED}={os.environ[ENV_REQUIRE_SIGNED]!r} must be 1 or 0")


def check_verifiable(where: str, required_by: str) -> Key:
    """The key readers verify markers with, where ``required_by`` (an option, or ``DCR_REQUIRE_SIGNED``)
    requires one: without it, a one-line ``UntrustedError`` naming ``where`` and what to set."""
    key = verify_key()
    if key is None:
        raise UntrustedError(f"{where}: {required_by} is set, and this reader has no key to verify with: set "
                             f"{ENV_VERIFY_KEY_FILE} (Ed25519) or {ENV_KEY} / {ENV_KEY_FILE} (HMAC)")
    return key


def keygen(path: str | os.PathLike) -> Key:
    """Write a new Ed25519 private key to ``path`` (mode 0600) and its public key to ``path``.pub;
    both must not exist yet. Returns the key."""
    path = os.fspath(path)
    private = Ed25519PrivateKey.generate()
    pem = private.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    pub = private.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    for target in (path, f"{path}.pub"):
        if os.path.lexists(target):
            raise UsageError(f"{target} exists; keygen never overwrites a key (move it away or choose another PATH)")
    _write_new(path, pem, 0o600)
    try:
        _write_new(f"{path}.pub", pub, 0o644)
    except BaseException:
        os.unlink(path)
        raise
    return Key(ED25519, path, private=private)


def _write_new(path: str, data: bytes, mode: int) -> None:
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
    except FileExistsError:
        raise UsageError(f"{path} exists; keygen never overwrites a key") from None
    except OSError as e:
        raise UsageError(f"{path}: cannot write the key ({e.strerror or e})") from None
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def public_key_b64(key: Key) -> str:
    """The raw Ed25519 public key, base64 (what people compare out of band)."""
    return base64.b64encode(_raw_public(key.ed25519_public())).decode()
