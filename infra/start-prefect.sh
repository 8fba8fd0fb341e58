#!/usr/bin/env bash
# Start a local Prefect API server on 127.0.0.1 for development; prints the PREFECT_API_URL to export.
# Usage: infra/start-prefect.sh [PORT]   (state under ${PREFECT_HOME:-.prefect})
set -euo pipefail
PORT="${1:-4200}"
export PREFECT_HOME="${PREFECT_HOME:-$PWD/.prefect}"
export PREFECT_SERVER_ANALYTICS_ENABLED=false
mkdir -p "$PREFECT_HOME"
prefect server start --host 127.0.0.1 --port "$PORT" >"$PREFECT_HOME/server.log" 2>&1 &
echo $! >"$PREFECT_HOME/server.pid"
for _ in $(seq 1 90); do
  if curl -sf "http://127.0.0.1:$PORT/api/health" >/dev/null; then
    echo "export PREFECT_API_URL=http://127.0.0.1:$PORT/api"
    exit 0
  fi
  sleep 1
done
echo "prefect server did not become healthy; see $PREFECT_HOME/server.log" >&2
exit 1
