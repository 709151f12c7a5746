#!/usr/bin/env bash
# The ways a user reaches a running Ray cluster, checked end to end on this machine against one
# local `ray start --head`:
#   1. `ray job submit -- layercheck train` (the demo, shortened, with an injected failure,
#      recovered in place by a warm spare);
#   2. `ray job submit -- python examples/own_loop_fsdp2.py` (the Python API in the user's own
#      PyTorch FSDP2 loop, recovered in place; the DeepSpeed one: tests/e2e/test_own_loop.py);
#   3. a driver on the head with RAY_ADDRESS unset (what `layercheck train` does first): it joins
#      the running cluster instead of starting its own.
#   scripts/check_job_submit.sh [STORAGE_DIR]    # each run's store is a folder below it
# Exits non-zero if any of them fails. Uses the Python of $VENV (default .venv).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY="$(cd "$VENV/bin" && pwd)/python"
RAY="$(cd "$VENV/bin" && pwd)/ray"
STORAGE=${1:-$(mktemp -d)/job-runs}
export RAY_AUTH_MODE=disabled   # the same for `ray start` and every CLI call (STACK-NOTES)
unset RAY_ADDRESS
# Ray's files (and the address file `ray start` writes, which a bare ray.init() on this machine
# joins) in a folder of this check's own: another Ray on the machine, a test's, neither joins
# this cluster nor is joined by the third check. Short: Ray's socket paths must fit in 107 bytes.
RAY_TMPDIR=$(mktemp -d /tmp/lcjob-XXXXXX)
export RAY_TMPDIR
port() { "$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
GCS=$(port); DASH=$(port)
# --block: the head's processes live as long as this `ray start` (Ray ends them when it gets
# SIGTERM), so the check stops its own cluster only; `ray stop` would end every Ray on the machine.
# Without a drain: on SIGTERM Ray 2.60 first drains the node for up to 30 s (for Serve replicas),
# which after the jobs here it sat out whole (31.7 s of the check's 129 s).
RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S=0 "$RAY" start --head --block --port="$GCS" --dashboard-host=127.0.0.1 --dashboard-port="$DASH" --num-cpus=4 \
  --disable-usage-stats >"$RAY_TMPDIR/head.log" 2>&1 &
HEAD=$!
stop_head() {
  local status=$?
  if [ "$status" -ne 0 ]; then  # what the head said, for the failure's reader
    kill -0 "$HEAD" 2>/dev/null && echo "--- the Ray head is up; its log:" || echo "--- the Ray head had exited; its log:"
    tail -n 40 "$RAY_TMPDIR/head.log" || true
  fi
  kill "$HEAD" 2>/dev/null || true
  wait "$HEAD" 2>/dev/null || true
  rm -rf "$RAY_TMPDIR"
  exit "$status"
}
trap stop_head EXIT
# the head is up once `ray start` wrote its address file (after its processes started)
for _ in $(seq 600); do
  [ -s "$RAY_TMPDIR/ray/ray_current_cluster" ] && break
  kill -0 "$HEAD" 2>/dev/null || { echo "ray start --head exited" >&2; exit 1; }  # stop_head shows its log
  sleep 0.2
done
[ -s "$RAY_TMPDIR/ray/ray_current_cluster" ] || { echo "the Ray head did not start in 120 s" >&2; exit 1; }
# `ray job submit`, again while the head's job agent has not registered yet ("No available agent
# to submit job": nothing was submitted), as a user retries it; any other failure ends the check
submit() {
  local out="$RAY_TMPDIR/submit.log"
  for _ in $(seq 30); do
    if "$RAY" job submit --address "http://127.0.0.1:$DASH" "$@" 2>&1 | tee "$out"; then return 0; fi
    grep -q "No available agent" "$out" || return 1
    echo "(the head's job agent is not up yet: submitting again)"
    sleep 2
  done
  return 1
}
SHORT=(--set steps=16 --set optim.total_steps=16 --set policy.warmup_steps=4 --set metrics.port=0)

echo "== 1. ray job submit: layercheck train (demo), in place with a warm spare"
submit --working-dir . -- \
  "$PY" -m layercheck.orchestrator.cli.main train examples/demo.toml --overwrite "${SHORT[@]}" \
  --set fault.kill_at_step=8 --set cluster.in_place=true --set cluster.spares=1 --set "storage=$STORAGE/demo"
"$PY" -m layercheck.orchestrator.cli.main inspect "$STORAGE/demo" >/dev/null

echo "== 2. ray job submit: your own FSDP2 loop (examples/own_loop_fsdp2.py), the API's default schedule, in place"
# (period 100: no layer is saved by the policy before the failure; attach's step-0 versions protect it)
submit --working-dir . -- \
  "$PY" examples/own_loop_fsdp2.py --steps 12 --period 100 --kill-at-step 6 --in-place --storage "$STORAGE/own-loop"
"$PY" -m layercheck.orchestrator.cli.main inspect "$STORAGE/own-loop" >/dev/null
"$PY" -m layercheck.orchestrator.cli.main export "$STORAGE/own-loop" --format hf --out "$STORAGE/own-loop-hf"

echo "== 3. a driver on the head with RAY_ADDRESS unset joins the running cluster"
# what `layercheck train` does before it trains (runtime.cluster.connect); 1. and 2. trained on it
"$PY" - <<'PY'
import logging

import ray

from layercheck.orchestrator.core.run_config import load_run_config
from layercheck.orchestrator.runtime.cluster import connect

logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
connect(load_run_config("examples/demo.toml"))
nodes = [n for n in ray.nodes() if n["Alive"]]
print(f"the driver sees {len(nodes)} node(s) with {sum(n['Resources'].get('CPU', 0) for n in nodes):g} CPUs")
PY

echo "ray job submit and joining a running cluster: OK (checkpoints in $STORAGE)"
