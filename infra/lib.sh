# Shared by the infra/start-*.sh scripts (sourced): the project's Python, and waiting for a server.
# The scripts need no activated virtualenv and nothing on PATH but bash: they use DCR_PYTHON if set,
# else the checkout's .venv (what `make install` builds), else a python3 on PATH that has the module.

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

die() { echo "$(basename "$0"): error: $*" >&2; exit 1; }

# find_python MODULE: prints the interpreter that can import MODULE, or fails naming what to do.
find_python() {
  local module="$1" candidate
  if [ -n "${DCR_PYTHON:-}" ] && [ ! -x "$DCR_PYTHON" ]; then
    die "DCR_PYTHON=$DCR_PYTHON is not an executable Python"
  fi
  for candidate in "${DCR_PYTHON:-}" "$REPO/.venv/bin/python" "$(command -v python3 2>/dev/null || true)"; do
    [ -n "$candidate" ] && [ -x "$candidate" ] || continue
    if "$candidate" -c "import $module" 2>/dev/null; then
      echo "$candidate"
      return 0
    fi
    [ -n "${DCR_PYTHON:-}" ] && [ "$candidate" = "$DCR_PYTHON" ] && die "DCR_PYTHON=$DCR_PYTHON cannot import $module"
  done
  die "no Python with $module found (tried \$DCR_PYTHON, $REPO/.venv, python3 on PATH); run 'make install' in $REPO or set DCR_PYTHON"
}

# port_free PYTHON PORT: fails (naming the port) if something already listens on 127.0.0.1:PORT.
port_free() {
  "$1" -c "import socket, sys; s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(('127.0.0.1', int(sys.argv[1]))); s.close()" "$2" 2>/dev/null \
    || die "port $2 on 127.0.0.1 is in use (another server?); pass another port as the first argument"
}

# wait_healthy PYTHON PID URL LOG SECONDS: returns once URL answers (any HTTP status); fails at once
# if the server process exits, and after SECONDS (stopping it), printing the end of its log either way.
wait_healthy() {
  local py="$1" pid="$2" url="$3" log="$4" seconds="$5" deadline
  deadline=$(( $(date +%s) + seconds ))
  while :; do
    if "$py" - "$url" <<'PY' 2>/dev/null; then return 0; fi
import sys, urllib.error, urllib.request
try:
    urllib.request.urlopen(sys.argv[1], timeout=2)
except urllib.error.HTTPError:
    pass  # the server answered
PY
    if ! kill -0 "$pid" 2>/dev/null; then
      tail -n 20 "$log" >&2 || true
      die "the server exited before it answered at $url (log: $log)"
    fi
    if [ "$(date +%s)" -ge "$deadline" ]; then
      kill "$pid" 2>/dev/null || true
      tail -n 20 "$log" >&2 || true
      die "no answer at $url after ${seconds} s; stopped it (log: $log)"
    fi
    sleep 0.3
  done
}
