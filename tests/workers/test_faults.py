"""The one fault hook (``layercheck.workers.faults``): a site does nothing unless an injector is
installed; ``LAYERCHECK_FAULTS`` names the test's injector, loaded at a process's first site and
carried to a joined cluster's processes; the run's rehearsal (``[fault] kill_at_step``,
``kill_rank``) goes through the same hook; and the test injector's plan (tests/support/faults.py),
the write stall's scope among it."""

import json
import math

import pytest

from layercheck.orchestrator.runtime.cluster import worker_env
from layercheck.policies.config_loader import ConfigError
from layercheck.workers import faults
from tests.support.faults import FaultPlan, InjectedFault, PlannedFaults


@pytest.fixture
def no_injector(monkeypatch):
    """This process as a fresh one: the environment not read yet, no rehearsal."""
    monkeypatch.delenv(faults.FAULTS_ENV, raising=False)
    monkeypatch.setattr(faults, "_loaded", False)
    monkeypatch.setattr(faults, "_injector", None)
    monkeypatch.setattr(faults, "_rehearsal", None)
    return monkeypatch


def test_nothing_fails_at_a_site_unless_an_injector_is_installed(no_injector):
    faults.fault_point(faults.AFTER_STEP, rank=1, step=6, attempt=1, coordinator=None)
    faults.fault_point(faults.SHARD_WRITE, writer="w", node_id="n", step=6, path="p")
    assert not faults.active()


def test_the_injector_the_environment_names_is_loaded_at_the_first_site(no_injector, tmp_path):
    plan = tmp_path / "plan.json"
    spec = {"injector": "tests.support.faults:PlannedFaults", "path": str(plan)}
    no_injector.setenv(faults.FAULTS_ENV, json.dumps(spec))
    faults.fault_point(faults.AFTER_STEP, rank=1, step=6, attempt=1, coordinator=None)  # no plan yet: nothing
    assert faults.active() and isinstance(faults.install(None), PlannedFaults)
    no_injector.setattr(faults, "_loaded", False)  # as a new process would, it reads the environment again
    plan.write_text(json.dumps({"raise_at_step": 6, "kill_rank": 1, "fail_in_place_recovery": True}))
    with pytest.raises(InjectedFault, match="rank 1's own step fails after step 6"):
        faults.fault_point(faults.AFTER_STEP, rank=1, step=6, attempt=1, coordinator=None)
    faults.fault_point(faults.AFTER_STEP, rank=1, step=6, attempt=2, coordinator=None)  # first attempt only
    faults.fault_point(faults.AFTER_STEP, rank=0, step=6, attempt=1, coordinator=None)  # its rank only
    with pytest.raises(InjectedFault, match="rank 0's recovery in its own process fails"):
        faults.fault_point(faults.JOINED, rank=0, attempt=2, incarnation=1)
    faults.fault_point(faults.JOINED, rank=1, attempt=2, incarnation=1)  # kill_rank's replacement recovers
    plan.unlink()  # read at each site: gone, nothing fails
    faults.fault_point(faults.AFTER_STEP, rank=1, step=6, attempt=1, coordinator=None)


def test_a_spec_that_names_no_injector_says_which_variable(no_injector):
    no_injector.setenv(faults.FAULTS_ENV, "tests.support.faults")
    with pytest.raises(ValueError, match=faults.FAULTS_ENV):
        faults.fault_point(faults.JOINED, rank=0, attempt=1, incarnation=0)
    no_injector.setenv(faults.FAULTS_ENV, "tests.support.faults:FaultPlan")  # module:attr, called with nothing
    faults.fault_point(faults.JOINED, rank=0, attempt=1, incarnation=0)
    assert isinstance(faults.install(None), FaultPlan)


def test_a_joined_clusters_processes_get_the_variable_in_the_jobs_environment():
    assert worker_env(use_gpu=False, environ={faults.FAULTS_ENV: "m:a"})[faults.FAULTS_ENV] == "m:a"
    assert faults.FAULTS_ENV not in worker_env(use_gpu=False, environ={})


def test_the_rehearsal_kills_its_rank_after_its_step_of_the_first_attempt_through_the_same_hook(no_injector):
    killed = []
    no_injector.setattr(faults, "die_after_step", lambda rank, step, coordinator: killed.append((rank, step)))
    faults.rehearse(6, 1)
    assert faults.active()
    for rank, step, attempt in [(1, 5, 1), (0, 6, 1), (1, 6, 2), (1, 6, 1)]:
        faults.fault_point(faults.AFTER_STEP, rank=rank, step=step, attempt=attempt, coordinator=None)
    faults.fault_point(faults.JOINED, rank=1, attempt=1, incarnation=0)
    assert killed == [(1, 6)]
    faults.rehearse(0, 1)  # kill_at_step 0: no rehearsal
    assert not faults.active()


def test_an_injected_write_stall_hits_the_chosen_nodes_writers_after_the_chosen_step():
    fault = FaultPlan(stall_writes_s=2.5, stall_writes_node="n2", stall_writes_after_step=6)
    assert [fault.stall_s(node_id=n, step=s) for n, s in (("n2", 7), ("n2", 6), ("n1", 7))] == [2.5, 0.0, 0.0]
    anywhere = FaultPlan(stall_writes_s=1.0)
    assert anywhere.stall_s(node_id="n1", step=1) == 1.0
    assert FaultPlan().stall_s(node_id="n1", step=99) == 0.0
    for bad in (math.nan, -1.0):  # a bad value names the field
        with pytest.raises(ConfigError, match="stall_writes_s"):
            FaultPlan(stall_writes_s=bad)
