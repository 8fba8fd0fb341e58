#!/usr/bin/env bash
# Start the GCS emulator on 127.0.0.1 (in memory) with a default bucket; prints what to export.
# Usage: infra/start-gcs.sh [PORT] [BUCKET]      (stop it: kill "$(cat "${TMPDIR:-/tmp}/dcr-gcs-PORT.pid")")
# The emulator ignores ifGenerationMatch preconditions: see docs/reference/backends.md.
# Uses the project's Python (DCR_PYTHON, else .venv); exits non-zero, with the emulator's log, if it
# does not come up.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
PORT="${1:-9023}"
BUCKET="${2:-dcr}"
LOG="${TMPDIR:-/tmp}/dcr-gcs-$PORT.log"
PY="$(find_python gcp_storage_emulator)"
port_free "$PY" "$PORT"
# infra/gcs_emulator.py: the emulator with a listen backlog that takes DCR's parallel requests (see there)
"$PY" "$REPO/infra/gcs_emulator.py" start --host 127.0.0.1 --port "$PORT" --in-memory --default-bucket "$BUCKET" >"$LOG" 2>&1 &
PID=$!
echo "$PID" >"${TMPDIR:-/tmp}/dcr-gcs-$PORT.pid"
wait_healthy "$PY" "$PID" "http://127.0.0.1:$PORT/storage/v1/b" "$LOG" 30
cat <<OUT
export STORAGE_EMULATOR_HOST=http://127.0.0.1:$PORT
# ROOT=gs://$BUCKET/run-1   (server log: $LOG)
OUT
