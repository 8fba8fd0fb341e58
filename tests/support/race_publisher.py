"""``python -m tests.support.race_publisher BARRIER_DIR N -- <dcr publish args>``: a real ``dcr publish``
process that, once its attempt is fully written (it reports reaching ``publish.manifest-written``),
waits until N publishers got that far, then commits. Used to make 16 separate processes race for
one commit marker on the S3 server."""

from __future__ import annotations

import os
import sys
import time
import uuid

from dcr_core import events
from flows.cli import main as cli


def main() -> int:
    barrier, n = sys.argv[1], int(sys.argv[2])
    args = sys.argv[sys.argv.index("--") + 1 :]

    def wait_for_the_others(point: str, fields: dict) -> None:
        if point != "publish.manifest-written":
            return
        open(os.path.join(barrier, uuid.uuid4().hex), "w").close()
        deadline = time.time() + 120
        while len(os.listdir(barrier)) < n and time.time() < deadline:
            time.sleep(0.01)

    with events.listening(wait_for_the_others):
        return cli(args)


if __name__ == "__main__":
    sys.exit(main())
