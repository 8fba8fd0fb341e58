"""The auditor's one call on every backend: ``dcr_zarr_codec.open_tensor`` with only fsspec's own
filesystems (no DCR storage code) reads local, memory://, S3 and GCS ROOTs, packed or not."""

from __future__ import annotations

from tests.support.auditor import PACK_BYTES, check_step_reads, publish_two


def test_the_auditor_reads_every_tensor_of_steps_with_and_without_packs(backend, make_root, tmp_path):
    url = make_root()
    # step 0 one object per chunk, step 1 packed: its chunks are byte ranges of data.zarr/%packs/<name>
    a, b = publish_two(url, tmp_path, pack_bytes=(0, PACK_BYTES))
    # gcsfs asks Google for credentials unless told the emulator needs none
    check_step_reads(url, a, b, {"token": "anon"} if backend == "gcs" else None)
