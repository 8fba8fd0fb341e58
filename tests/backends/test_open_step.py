"""The auditor's one call on every backend: ``dcr_zarr_codec.open_tensor`` with only fsspec's own
filesystems (no DCR storage code) reads local, memory://, S3 and GCS ROOTs, packed or not."""

from __future__ import annotations

from tests.support.auditor import check_step_reads, publish_two
from tests.support.packed import repack


def test_the_auditor_reads_every_tensor_of_steps_with_and_without_packs(backend, make_root, tmp_path):
    url = make_root()
    a, b = publish_two(url, tmp_path)
    repack(url, 1)  # step 0 keeps one object per chunk, step 1 is packed
    # gcsfs asks Google for credentials unless told the emulator needs none
    check_step_reads(url, a, b, {"token": "anon"} if backend == "gcs" else None)
