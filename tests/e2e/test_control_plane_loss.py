"""The run's control actors SIGKILLed mid-run on a real local Ray (the test injector's
``kill_policy_actor_at_step`` and ``kill_supervisor_at_step``, ``tests/support/faults.py``, as
``kill -9`` of ``ray::PolicyActor`` or ``ray::SupervisorActor`` would).

The policy actor is rebuilt by Ray and the run goes on: the group it served fails at the first
answer it needs, is recovered at ``t_fail + 1`` from every rank's capture, and trains on the
failure-free trajectory. The supervisor, whose writers die with it, is not rebuilt: the run ends
with one line naming the loss and the command that resumes it from its store, which then resumes.
The pieces, with fakes at the exact points: ``tests/orchestrator/runtime/test_policy_actor_rebuilt.py``,
``tests/orchestrator/runtime/test_supervisor_loss.py``, ``tests/orchestrator/core/test_run_supervisor.py``."""

import shlex

import pytest

from layercheck.orchestrator.runtime.run_summary import format_summary, summarize
from layercheck.policies.configs import StaggeredConfig
from tests.support.faults import FaultPlan, faults_env, injected
from tests.support.ray_runs import STEPS, demo_config, train_demo
from tests.support.train_proc import start_train

pytestmark = pytest.mark.slow

#: The default schedule with quiet steps: drift measured at steps 1, 4, 7, 10; the ranks carry out
#: the steps between from the plan the measured step's answer carried, asking the actor nothing.
QUIET = StaggeredConfig(period=4, smax=8, drift_every=3)


def test_a_sigkilled_policy_actor_is_rebuilt_and_the_run_recovers_on_the_failure_free_trajectory(
    local_ray, clean_run, tmp_path
):
    """SIGKILLed after step 5, inside a plan: the ranks carry out its quiet steps, then each fails
    at the first answer only the dead actor could have given (a call that died with it, or the
    rebuilt one's refusal). Ray Train restarts the group; it resumes at t_fail + 1 from the ranks'
    captures (every rank survived: nothing is stale), and the rebuilt actor, rebased there, decides
    the new group's steps. Every step trains once, each loss the failure-free run's."""
    with injected(FaultPlan(kill_policy_actor_at_step=5)):
        failed = train_demo(tmp_path, "policy-killed", policy=QUIET, **{"fault.kill_at_step": 0})
    assert failed.error is None and failed.status["state"] == "finished"
    account = failed.status["account"]
    assert account["failures"] == 1
    (recovery,) = account["recoveries"]
    t_fail = recovery["t_fail"]
    assert 5 <= t_fail <= 8 and recovery["resumed_at"] == t_fail + 1 and recovery["steps_redone"] == 0, recovery
    assert recovery["max_staleness"] == 0, recovery  # every rank's own state at t_fail
    # no step skipped or repeated: each trained once. Rank 0 reports a step's loss after it collects
    # the decision before it, so the loss of the step it failed collecting after (t_fail, when the
    # captures are one past its last report) died with the group; its state did not
    history = {int(k): v[0] for k, v in account["history"].items()}
    assert set(range(1, STEPS + 1)) - set(history) <= {t_fail} and max(history) == STEPS, sorted(history)
    reference = {int(k): v[0] for k, v in clean_run.status["account"]["history"].items()}
    for step, loss in history.items():
        assert loss == pytest.approx(reference[step], rel=1e-5, abs=1e-6), step
    # the rebuilt actor decided the steps after the recovery: the drift trace holds them (those
    # before died with the old process), and the summary reads it
    assert [o.step for o in failed.trace.steps] == list(range(t_fail + 1, STEPS + 1))
    assert "recovery after step" in format_summary(summarize(failed))


def test_a_sigkilled_supervisor_ends_the_run_with_one_line_and_the_resume_command_which_resumes(
    local_ray, tmp_path, ray_tmp
):
    """``layercheck train`` as a user runs it; the supervisor (and with it the writers) SIGKILLed
    after step 6. The ranks fail at their next hand-over to a dead writer (or stop, asked by the
    driver's poll that saw the death), and Ray Train's controller ends the run instead of restarting
    the group: exit status 1, the error one line naming the loss (no ``WorkerGroupError``, no
    traceback in the summary), then the resume command on stderr. That command's ``--resume``
    continues the store from its newest recoverable step and trains to the end."""
    name = "supervisor-killed"
    config = demo_config(tmp_path, name)
    sets = [
        f"storage={config.storage_uri}",
        f"steps={STEPS}",
        f"optim.total_steps={STEPS}",
        "optim.warmup_steps=2",
        "policy.period=4",
        "fault.kill_at_step=0",
        "metrics.port=0",
    ]
    with injected(FaultPlan(kill_supervisor_at_step=6)), faults_env():
        run = start_train(tmp_path, *sets, ray_tmp=ray_tmp)
        out = run.finish(timeout=600)
    err = run.stderr
    assert run.proc.returncode == 1, err[-4000:]
    assert "failed (the run's supervisor actor died (its persistence writers with it" in out, out[-3000:]
    assert "WorkerGroupError" not in out and "Traceback" not in out, out[-3000:]
    command = "layercheck train examples/demo.toml " + " ".join(f"--set {shlex.quote(s)}" for s in sets)
    lines = err.splitlines()  # (Ray's own log lines may still come after them)
    said = [
        i for i, line in enumerate(lines) if line.endswith("To continue this run from its newest recoverable step:")
    ]
    assert len(said) == 1 and lines[said[0]].startswith("the run's supervisor actor died"), err[-4000:]
    assert lines[said[0] + 1].strip() == f"{command} --resume", lines[said[0] + 1]

    resumed = train_demo(
        tmp_path, name, resume=True, **{"policy.period": 4, "fault.kill_at_step": 0, "optim.warmup_steps": 2}
    )
    assert resumed.status["state"] == "finished"
    (recovery,) = resumed.status["account"]["recoveries"]
    assert recovery["kind"] == "resume" and 1 < recovery["resumed_at"] <= 8, recovery  # what was committed came back
    assert sorted(int(k) for k in resumed.status["account"]["history"]) == list(
        range(recovery["resumed_at"], STEPS + 1)
    )
