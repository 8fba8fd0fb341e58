"""A committed step turned into the packed layout (manifest schema 3) by hand, for readers' tests.

Every stored chunk object of the step's attempt is appended to pack objects (``packs/<tag>.<k:06d>``
under the attempt, sealed once one holds ``pack_bytes``), the manifest lists the packs and gives each
chunk its pack and offset, and the attempt's ``data.zarr`` (chunk objects and ``zarr.json``
documents) is deleted: what a packed publish leaves. The commit marker keeps the old manifest
digest, so only readers that do not check it (the auditor's ``dcr_zarr_codec.open_step``) read it.
"""

from __future__ import annotations

import json

import blake3

from storage import layout
from storage.manifest import Manifest
from storage.root import Root

WRITER_TAG = "0badc0de"


def repack(url: str, step: int, pack_bytes: int = 200) -> dict:
    """Repack committed ``step`` of ROOT ``url``; returns the new manifest (as JSON data)."""
    root = Root(url)
    attempt = json.loads(root.read(layout.commit_key(step)))["attempt"]
    raw = json.loads(root.read(layout.manifest_key(step, attempt)))
    parsed = Manifest.from_dict(raw, "manifest")
    packs: list[dict] = []
    pending = bytearray()

    def seal() -> None:
        name = f"{WRITER_TAG}.{len(packs):06d}"
        root.write(f"{layout.attempt_dir(step, attempt)}/packs/{name}", bytes(pending))
        packs.append({"name": name, "bytes": len(pending), "digest": blake3.blake3(bytes(pending)).hexdigest()})
        pending.clear()

    for table, entries in (("tensors", parsed.tensors), ("snapshot", parsed.snapshot)):
        for name, entry in entries.items():
            assert entry.parts is None, "parts are not packed here"
            where, offsets = [], []
            for pos in range(len(entry.chunks)):
                key = layout.store_key(step, attempt, entry.stored_at(pos)[0])
                where.append(len(packs))
                offsets.append(len(pending))
                pending.extend(root.read(key))
                if len(pending) >= pack_bytes:
                    seal()
            raw[table][name]["chunks"] |= {"pack": where, "offset": offsets}
    if pending:
        seal()
    raw["schema_version"] = 3
    raw["packs"] = packs
    root.remove(layout.store_dir(step, attempt), recursive=True)
    root.write(layout.manifest_key(step, attempt), json.dumps(raw, indent=1).encode())
    return raw
