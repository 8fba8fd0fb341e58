#!/usr/bin/env bash
# Start Azurite, the Azure Storage emulator (its blob service only), on 127.0.0.1, in memory, with a
# container; prints what to export.
# Usage: infra/start-azurite.sh [PORT] [CONTAINER]   (stop it: kill "$(cat "${TMPDIR:-/tmp}/dcr-azurite-PORT.pid")")
# Azurite comes from the npm registry (azurite@3.37.0, pinned), installed on first use into
# DCR_AZURITE_DIR (default: ~/.cache/dcr-azurite-3.37.0): needs Node.js and npm. The container is made
# with the project's Python (DCR_PYTHON, else .venv: azure-storage-blob comes with adlfs). The account
# is Azurite's well-known development account, devstoreaccount1, with its published key.
# Exits non-zero, with the server's log, if it does not come up.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
PORT="${1:-10000}"
CONTAINER="${2:-dcr}"
VERSION=3.37.0
DIR="${DCR_AZURITE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/dcr-azurite-$VERSION}"
LOG="${TMPDIR:-/tmp}/dcr-azurite-$PORT.log"
# Azurite's development account and key, published in Azure's documentation (not a secret)
KEY="Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
PY="$(find_python azure.storage.blob)"
port_free "$PY" "$PORT"
BIN="$DIR/node_modules/.bin/azurite-blob"
if [ ! -x "$BIN" ]; then
  command -v npm >/dev/null 2>&1 || die "npm not found: install Node.js and npm (Azurite is an npm package), or set DCR_AZURITE_DIR to a directory where azurite@$VERSION is installed"
  echo "installing azurite@$VERSION from the npm registry into $DIR" >&2
  mkdir -p "$(dirname "$DIR")"
  STAGE="$(mktemp -d "$DIR.XXXXXX")"  # installed beside its place, then renamed: never half there
  if ! npm install --prefix "$STAGE" --no-audit --no-fund --loglevel=error "azurite@$VERSION" >"$STAGE.log" 2>&1; then
    tail -n 20 "$STAGE.log" >&2 || true
    rm -rf "$STAGE"
    die "npm install azurite@$VERSION failed (log: $STAGE.log)"
  fi
  mv -T "$STAGE" "$DIR" 2>/dev/null || rm -rf "$STAGE"  # another install got there first: keep that one
  rm -f "$STAGE.log"
fi
# --skipApiVersionCheck: the Azure SDK may speak a newer API version than this Azurite knows
"$BIN" --blobHost 127.0.0.1 --blobPort "$PORT" --inMemoryPersistence --disableTelemetry --skipApiVersionCheck \
  --silent >"$LOG" 2>&1 &
PID=$!
echo "$PID" >"${TMPDIR:-/tmp}/dcr-azurite-$PORT.pid"
wait_healthy "$PY" "$PID" "http://127.0.0.1:$PORT/devstoreaccount1?comp=list" "$LOG" 30
CONN="DefaultEndpointsProtocol=http;AccountName=devstoreaccount1;AccountKey=$KEY;BlobEndpoint=http://127.0.0.1:$PORT/devstoreaccount1;"
"$PY" -c "import sys
from azure.core.exceptions import ResourceExistsError
from azure.storage.blob import BlobServiceClient
try:
    BlobServiceClient.from_connection_string(sys.argv[1]).create_container(sys.argv[2])
except ResourceExistsError:
    pass" "$CONN" "$CONTAINER" || die "could not create container $CONTAINER"
cat <<OUT
export AZURE_STORAGE_CONNECTION_STRING='$CONN'
# ROOT=az://$CONTAINER/run-1   (server log: $LOG)
OUT
