"""``dcr keygen PATH``: an Ed25519 key pair for signed commit markers (see ``storage.signing``)."""

from __future__ import annotations

from storage import signing


def add_arguments(name: str, p) -> None:
    p.add_argument("path", metavar="PATH", help="where the private key goes (mode 0600); the public key goes to PATH.pub")


def run(name: str, args) -> int:
    key = signing.keygen(args.path)
    print(f"private key: {args.path} (publishers: {signing.ENV_KEY_FILE}={args.path})")
    print(f"public key:  {args.path}.pub (receivers and mirrors: {signing.ENV_VERIFY_KEY_FILE}={args.path}.pub)")
    print(f"key id:      {key.fingerprint}  raw public key (base64): {signing.public_key_b64(key)}")
    return 0
