"""One ``layercheck train`` run on S3 (a local Ray; storage on the loopback S3 server, the moto
fixture), stopped four ways and resumed with ``--resume`` on the same store after each, as a
user would:

1. its driver is SIGKILLed (``kill -9``, the OOM killer): nothing it committed is lost;
2. ``--resume`` takes over the dead driver's lease and continues at the newest recoverable step
   + 1; S3 then goes away: the writes fail, the staleness bound's breach stops the run cleanly
   with its summary and the resume command, and what was committed before the outage stays;
3. once the outage is over, ``--resume`` continues again, and Ctrl-C stops it with the summary,
   every layer's final state in the store and the resume command;
4. ``--resume`` again, and SIGTERM to its driver alone (``kill PID``, a scheduler stopping the
   job) stops it the same way, saying so.

One chain of four runs rather than a run and its resume for each (each run is a Ray start and
its workers' imports): each resume also checks that the previous stop left a resumable store."""

import os
import re
import shlex
import signal

import pytest

from layercheck.orchestrator.core.run_checks import check_model
from layercheck.orchestrator.core.run_config import load_run_config
from layercheck.orchestrator.store.layer_store import LayerStore
from layercheck.policies.plan import newest_recoverable_step
from tests.support.s3_server import FAST_FAIL
from tests.support.store_helpers import newest_steps
from tests.support.train_proc import TrainProcess, kill_run, start_train

pytestmark = pytest.mark.slow
#: Long enough that no run ends by itself: each is stopped.
STEPS = 2000
SETTINGS = (
    f"steps={STEPS}",
    f"optim.total_steps={STEPS}",
    "policy.warmup_steps=2",
    "policy.period=3",  # every layer saved every 3 steps: a composite soon, and a few failed writes break smax
    "policy.smax=3",
    "fault.kill_at_step=0",
    "metrics.port=0",
    "log_every=1",
)


def wait_for_every_layer(run: TrainProcess, uri: str, layers: set[str], after: int) -> set[str]:
    """Follow ``run`` until every layer has a committed version past step ``after``; the ids
    committed by then."""
    step = run.wait_for_step(after + 1)
    while {v.layer for v in LayerStore.open(uri).versions() if v.step > after} != layers:
        step = run.wait_for_step(step + 1)
    return {v.version_id for v in LayerStore.open(uri).versions()}


def test_a_killed_an_s3_starved_and_an_interrupted_run_each_resume_where_they_stopped(tmp_path, ray_tmp, s3):
    uri = s3.uri("runs/stopped", **FAST_FAIL)
    # the run under the outage does not retry a failed request: each of the writes it queued up
    # fails at once (the outage shows in the first), where FAST_FAIL's retry would take its
    # backoff for each; the other runs retry as FAST_FAIL says
    no_retry = s3.uri("runs/stopped", **{**FAST_FAIL, "retry_max_attempts": "1"})
    layers = set(check_model(load_run_config("examples/demo.toml").model).numel)

    # 1. the driver SIGKILLed once the store holds a composite
    killed = start_train(tmp_path, *SETTINGS, f"storage={uri}", ray_tmp=ray_tmp)
    committed = wait_for_every_layer(killed, uri, layers, after=0)
    kill_run(killed)  # the driver alone, like kill -9; then what it started (its local Ray)
    store = LayerStore.open(uri)
    after = store.versions()
    assert committed <= {v.version_id for v in after}  # every version committed before the kill is there
    for record in after:
        assert store.check_version(record, deep=True) == [], record.version_id  # and readable
    newest = newest_recoverable_step({v.layer for v in after}, store.manifest().refs())
    assert newest is not None

    # 2. resumed: takes the dead driver's lease; then S3 goes away
    starved = start_train(tmp_path, *SETTINGS, f"storage={no_retry}", ray_tmp=ray_tmp, args=("--resume",))
    committed = wait_for_every_layer(starved, uri, layers, after=newest)
    s3.proxy.cut()
    out = starved.finish(timeout=600)
    err = starved.stderr
    assert re.search(rf"taking over .*its process {killed.proc.pid} on this host is gone", err), err[-3000:]
    assert f"continuing at step {newest + 1} of {STEPS}" in err, err[-3000:]
    assert starved.proc.returncode == 1, err[-3000:]
    assert "STALENESS BOUND BROKEN" in out and "staleness bound" in out, out[-3000:]
    assert "--resume" in err, err[-3000:]  # the resume command of a stopped run
    assert "NETWORK_CONNECTION" in err and "lc-dummy" not in err + out  # the cause; no credentials

    # 3. resumed once S3 is back; then Ctrl-C
    s3.proxy.restore()
    store = LayerStore.open(uri)
    assert committed <= {v.version_id for v in store.versions()}  # what was committed before the outage stays
    newest = newest_recoverable_step({v.layer for v in store.versions()}, store.manifest().refs())
    interrupted = start_train(tmp_path, *SETTINGS, f"storage={uri}", ray_tmp=ray_tmp, args=("--resume",))
    interrupted.wait_for_step(newest + 4)
    os.killpg(interrupted.proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does: the whole foreground group
    out = interrupted.finish(timeout=300)
    err = interrupted.stderr
    assert f"continuing at step {newest + 1} of {STEPS}" in err, err[-3000:]
    assert interrupted.proc.returncode == 130, err[-3000:]
    assert "stopped after step" in out and "interrupted (Ctrl-C)" in out, out[-3000:]
    assert shlex.quote(f"storage={uri}") in err and "--resume" in err, err[-3000:]
    final = newest_steps(uri)
    stopped = max(final.values())
    assert stopped >= newest + 4 and set(final.values()) == {stopped}  # every layer's final state, at the stop step

    # 4. resumed again; then SIGTERM to the driver alone, as `kill PID` or a scheduler sends it
    terminated = start_train(tmp_path, *SETTINGS, f"storage={uri}", ray_tmp=ray_tmp, args=("--resume",))
    terminated.wait_for_step(stopped + 4)
    os.kill(terminated.proc.pid, signal.SIGTERM)
    out = terminated.finish(timeout=300)
    err = terminated.stderr
    assert f"continuing at step {stopped + 1} of {STEPS}" in err, err[-3000:]
    assert terminated.proc.returncode == 130, err[-3000:]
    assert "stopped after step" in out and "interrupted (SIGTERM)" in out, out[-3000:]
    assert shlex.quote(f"storage={uri}") in err and "--resume" in err, err[-3000:]
    final = newest_steps(uri)
    assert max(final.values()) >= stopped + 4 and set(final.values()) == {max(final.values())}
