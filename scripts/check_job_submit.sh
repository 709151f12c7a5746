#!/usr/bin/env bash
# The `ray job submit` path, checked end to end on this machine: start a local Ray head,
# submit the demo (shortened) as a job from this checkout, wait for it, stop Ray.
#   scripts/check_job_submit.sh [STORAGE_DIR]
# Exits non-zero if the job does not succeed. Uses the Python of $VENV (default .venv).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY="$(cd "$VENV/bin" && pwd)/python"
RAY="$(cd "$VENV/bin" && pwd)/ray"
STORAGE=${1:-$(mktemp -d)/job-run}
export RAY_AUTH_MODE=disabled   # the same for `ray start` and every CLI call (STACK-NOTES)
port() { "$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
GCS=$(port); DASH=$(port)
"$RAY" start --head --port="$GCS" --dashboard-host=127.0.0.1 --dashboard-port="$DASH" --num-cpus=4 \
  --disable-usage-stats >/dev/null
trap '"$RAY" stop --force >/dev/null 2>&1 || true' EXIT
"$RAY" job submit --address "http://127.0.0.1:$DASH" --working-dir . -- \
  "$PY" -m orchestrator.cli.main train examples/demo.toml --overwrite \
  --set steps=16 --set optim.total_steps=16 --set policy.warmup_steps=4 --set fault.kill_at_step=8 \
  --set metrics.port=0 --set "storage=$STORAGE"
"$PY" -m orchestrator.cli.main inspect "$STORAGE" >/dev/null
echo "ray job submit: OK (checkpoints in $STORAGE)"
