#!/usr/bin/env bash
# Start a moto S3 server on 127.0.0.1 for development and create a bucket; prints what to export.
# Usage: infra/start-s3.sh [PORT] [BUCKET]
set -euo pipefail
PORT="${1:-9000}"
BUCKET="${2:-dcr}"
LOG="${TMPDIR:-/tmp}/dcr-moto-$PORT.log"
moto_server -H 127.0.0.1 -p "$PORT" >"$LOG" 2>&1 &
echo $! >"${TMPDIR:-/tmp}/dcr-moto-$PORT.pid"
for _ in $(seq 1 60); do
  curl -sf "http://127.0.0.1:$PORT/" >/dev/null 2>&1 && break
  sleep 0.5
done
export AWS_ACCESS_KEY_ID=testing AWS_SECRET_ACCESS_KEY=testing AWS_DEFAULT_REGION=us-east-1
python -c "import boto3; boto3.client('s3', endpoint_url='http://127.0.0.1:$PORT').create_bucket(Bucket='$BUCKET')"
cat <<OUT
export AWS_ENDPOINT_URL=http://127.0.0.1:$PORT AWS_ACCESS_KEY_ID=testing AWS_SECRET_ACCESS_KEY=testing AWS_DEFAULT_REGION=us-east-1
# ROOT=s3://$BUCKET/run-1   (server log: $LOG)
OUT
