"""The storage backends, one class each, registered by URL scheme: what differs between object
stores (opening them, their endpoints and defaults, who retries, the atomic create-if-absent, their
quirks and capabilities) is said in the backend's own module and nowhere else.

Create-if-absent is the one write that makes a step (or anything else) real; of racing publishers
exactly one wins. Atomicity per backend (each module says how):

| backend | module | create-if-absent | atomic |
|---|---|---|---|
| local files | ``local`` | complete temp file, ``os.link`` to the name | yes |
| ``memory://`` | ``memory`` | check and write under a process-wide lock | within the process (its whole extent) |
| S3 (s3fs) | ``s3`` | ``PutObject`` with ``If-None-Match: *`` | yes (AWS; servers that honour the header: moto 5) |
| GCS (gcsfs) | ``gcs`` | upload with ``ifGenerationMatch=0`` | on real GCS; the emulator ignores it |
| Azure (adlfs) | ``azure`` | ``Put Blob`` with ``If-None-Match: *`` | yes (Azure, Azurite) |
| anything else | ``base.OtherBackend`` | refused, rather than silently racy | - |

The registry (``registry``) maps URL schemes to backend classes. A new backend is a module here
with its ``Backend`` subclass, and its line in ``registry.BACKENDS`` (docs/guides/add-a-backend.md).
"""
