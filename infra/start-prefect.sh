#!/usr/bin/env bash
# Start a local Prefect API server on 127.0.0.1 for development; prints the PREFECT_API_URL to export.
# Usage: infra/start-prefect.sh [PORT]   (state under ${PREFECT_HOME:-.prefect}; stop it: kill "$(cat .prefect/server.pid)")
# Uses the project's Python (DCR_PYTHON, else .venv); exits non-zero, with the server's log, if it
# does not come up. Telemetry is off: nothing is sent anywhere.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
PORT="${1:-${DCR_PREFECT_PORT:-4200}}"
export PREFECT_HOME="${PREFECT_HOME:-$PWD/.prefect}"
export PREFECT_SERVER_ANALYTICS_ENABLED=false
mkdir -p "$PREFECT_HOME"
PY="$(find_python prefect)"
port_free "$PY" "$PORT"
LOG="$PREFECT_HOME/server.log"
API_URL="http://127.0.0.1:$PORT/api"
# The UI in the browser asks the server which API to call (/ui-settings): unless told, that is the
# PREFECT_API_URL of this shell (a server started earlier?) or 127.0.0.1:4200, never --port's.
export PREFECT_SERVER_API_HOST=127.0.0.1 PREFECT_SERVER_API_PORT="$PORT"
export PREFECT_API_URL="$API_URL" PREFECT_SERVER_UI_API_URL="$API_URL"
"$PY" -m prefect server start --host 127.0.0.1 --port "$PORT" >"$LOG" 2>&1 &
PID=$!
echo "$PID" >"$PREFECT_HOME/server.pid"
wait_healthy "$PY" "$PID" "$API_URL/health" "$LOG" 90
echo "export PREFECT_API_URL=$API_URL"
