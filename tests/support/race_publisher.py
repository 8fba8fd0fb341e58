"""``python -m tests.support.race_publisher BARRIER_DIR N -- <dcr publish args>``: a real ``dcr publish``
process that, once its attempt is fully written, waits until N publishers got that far, then
commits. Used to make 16 separate processes race for one commit marker on the S3 server."""

from __future__ import annotations

import os
import sys
import time
import uuid


def main() -> int:
    barrier, n = sys.argv[1], int(sys.argv[2])
    args = sys.argv[sys.argv.index("--") + 1 :]
    from flows import pipeline, publish_steps

    real = publish_steps.commit_step

    def gated(plan, manifest, digest):
        open(os.path.join(barrier, uuid.uuid4().hex), "w").close()
        deadline = time.time() + 120
        while len(os.listdir(barrier)) < n and time.time() < deadline:
            time.sleep(0.01)
        return real(plan, manifest, digest)

    pipeline.LOCAL.commit_step = gated
    from flows.cli import main as cli

    return cli(args)


if __name__ == "__main__":
    sys.exit(main())
