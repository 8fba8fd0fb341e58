#!/usr/bin/env bash
# Start a moto S3 server on 127.0.0.1 for development and create a bucket; prints what to export.
# Usage: infra/start-s3.sh [PORT] [BUCKET]       (stop it: kill "$(cat "${TMPDIR:-/tmp}/dcr-moto-PORT.pid")")
# Uses the project's Python (DCR_PYTHON, else .venv); exits non-zero, with the server's log, if it
# does not come up.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
PORT="${1:-9000}"
BUCKET="${2:-dcr}"
LOG="${TMPDIR:-/tmp}/dcr-moto-$PORT.log"
PY="$(find_python moto.server)"
port_free "$PY" "$PORT"
"$PY" -m moto.server -H 127.0.0.1 -p "$PORT" >"$LOG" 2>&1 &
PID=$!
echo "$PID" >"${TMPDIR:-/tmp}/dcr-moto-$PORT.pid"
wait_healthy "$PY" "$PID" "http://127.0.0.1:$PORT/" "$LOG" 30
AWS_ACCESS_KEY_ID=testing AWS_SECRET_ACCESS_KEY=testing AWS_DEFAULT_REGION=us-east-1 "$PY" -c \
  "import boto3, sys; boto3.client('s3', endpoint_url=sys.argv[1]).create_bucket(Bucket=sys.argv[2])" \
  "http://127.0.0.1:$PORT" "$BUCKET" || die "could not create bucket $BUCKET"
cat <<OUT
export AWS_ENDPOINT_URL=http://127.0.0.1:$PORT AWS_ACCESS_KEY_ID=testing AWS_SECRET_ACCESS_KEY=testing AWS_DEFAULT_REGION=us-east-1
# ROOT=s3://$BUCKET/run-1   (server log: $LOG)
OUT
