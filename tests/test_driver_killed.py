"""SIGKILL of a live ``layercheck train`` driver mid-run: nothing it
committed is lost, and ``--resume`` on the same store takes over the dead driver's lease and
continues from the newest recoverable step + 1 to the end."""

import re

import pytest

from layercheck.orchestrator.store.layer_store import LayerStore
from layercheck.policies.plan import newest_recoverable_step
from tests.support.train_proc import kill_run, start_train

pytestmark = pytest.mark.slow
STEPS = 40


def run_settings(storage):
    return (
        f"steps={STEPS}",
        f"optim.total_steps={STEPS}",
        "policy.warmup_steps=2",
        "policy.period=5",  # every layer has a version within a few steps: a composite long before the kill
        "fault.kill_at_step=0",
        "metrics.port=0",
        f"storage={storage}",
        "log_every=1",
    )


def test_sigkill_of_a_live_driver_loses_nothing_and_resume_continues(tmp_path, ray_tmp):
    storage = tmp_path / "killed"
    run = start_train(tmp_path, *run_settings(storage), ray_tmp=ray_tmp)
    run.wait_for_step(20)
    committed = {v.version_id for v in LayerStore.open(str(storage)).versions()}
    kill_run(run)  # the driver alone, like kill -9; then what it started (its local Ray)
    assert committed, "nothing was committed before the kill"

    store = LayerStore.open(str(storage))
    after = store.versions()
    assert committed <= {v.version_id for v in after}  # every version committed before the kill is there
    for record in after:
        assert store.check_version(record, deep=True) == [], record.version_id  # and readable
    newest = newest_recoverable_step({v.layer for v in after}, store.manifest().refs())
    assert newest is not None and newest < STEPS

    resumed = start_train(tmp_path, *run_settings(storage), ray_tmp=ray_tmp, args=("--resume",))
    out = resumed.finish(timeout=600)
    err = resumed.stderr
    assert resumed.proc.returncode == 0, err[-3000:]
    assert re.search(rf"taking over .*its process {run.proc.pid} on this host is gone", err), err[-3000:]
    assert f"continuing at step {newest + 1} of {STEPS}" in err, err[-3000:]
    final = {}
    for version in LayerStore.open(str(storage)).versions():
        final[version.layer] = max(version.step, final.get(version.layer, 0))
    assert set(final.values()) == {STEPS}, out[-2000:]
