#!/usr/bin/env bash
# `ray job submit --working-dir . -- python examples/own_loop.py` against a local Ray head, as a
# user of the Python API runs their own loop:
#   scripts/check_own_loop_job_submit.sh [STORAGE_DIR]
# Exits non-zero if the job does not succeed. Uses the Python of $VENV (default .venv).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY="$(cd "$VENV/bin" && pwd)/python"
RAY="$(cd "$VENV/bin" && pwd)/ray"
STORAGE=${1:-$(mktemp -d)/own-loop-job}
export RAY_AUTH_MODE=disabled   # the same for `ray start` and every CLI call (STACK-NOTES)
port() { "$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
GCS=$(port); DASH=$(port)
"$RAY" start --head --port="$GCS" --dashboard-host=127.0.0.1 --dashboard-port="$DASH" --num-cpus=4 \
  --disable-usage-stats >/dev/null
trap '"$RAY" stop --force >/dev/null 2>&1 || true' EXIT
"$RAY" job submit --address "http://127.0.0.1:$DASH" --working-dir . -- \
  "$PY" examples/own_loop.py --steps 12 --kill-at-step 6 --storage "$STORAGE"
"$PY" -m orchestrator.cli.main inspect "$STORAGE" >/dev/null
echo "ray job submit (own loop): OK (checkpoints in $STORAGE)"
