"""The GCS emulator as DCR's tests and infra/start-gcs.sh start it: ``gcp-storage-emulator``, less two
costs of its own.

- Its HTTP server serves one connection at a time and keeps the standard library's listen backlog
  of 5: with DCR's 8 parallel requests, connections beyond the backlog were dropped and the client
  sent its SYN again a second later, so a test waited for seconds with client and server both
  idle. The backlog here is 128.
- In memory (``--in-memory``) the emulator still serialises the metadata of every object it holds to
  JSON on every write (its ``.meta`` snapshot, read back only when a store starts from disk), so each
  write costs time in proportion to everything written before: a shared emulator spent minutes of a
  run on it (a write took 3.6 ms with 300 objects held and 27 ms with 1,800). Nothing reads that
  snapshot back in memory mode, so it is not written.

Every request is still served as the emulator serves it.

Usage: ``python infra/gcs_emulator.py start --host 127.0.0.1 --port N --in-memory ...`` (the
emulator's own arguments).
"""

from __future__ import annotations

import http.server
import sys

from gcp_storage_emulator.__main__ import main
from gcp_storage_emulator.storage import Storage

_write_snapshot = Storage._write_config_to_file


def _write_snapshot_on_disk_only(self: Storage) -> None:
    if not self._use_memory_fs:
        _write_snapshot(self)


Storage._write_config_to_file = _write_snapshot_on_disk_only
http.server.HTTPServer.request_queue_size = 128  # the emulator's server class; this process serves nothing else

if __name__ == "__main__":
    sys.exit(main())
