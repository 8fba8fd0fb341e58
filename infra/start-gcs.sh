#!/usr/bin/env bash
# Start the GCS emulator on 127.0.0.1 (in memory) with a default bucket; prints what to export.
# Usage: infra/start-gcs.sh [PORT] [BUCKET]
# The emulator ignores ifGenerationMatch preconditions: see README, "Backends".
set -euo pipefail
PORT="${1:-9023}"
BUCKET="${2:-dcr}"
LOG="${TMPDIR:-/tmp}/dcr-gcs-$PORT.log"
gcp-storage-emulator start --host 127.0.0.1 --port "$PORT" --in-memory --default-bucket "$BUCKET" >"$LOG" 2>&1 &
echo $! >"${TMPDIR:-/tmp}/dcr-gcs-$PORT.pid"
for _ in $(seq 1 60); do
  curl -sf "http://127.0.0.1:$PORT/storage/v1/b" >/dev/null 2>&1 && break
  sleep 0.5
done
cat <<OUT
export STORAGE_EMULATOR_HOST=http://127.0.0.1:$PORT
# ROOT=gs://$BUCKET/run-1   (server log: $LOG)
OUT
