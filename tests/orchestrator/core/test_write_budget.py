"""The write budget from the writers' drain bandwidth (pure)."""

from __future__ import annotations

import pytest

from layercheck.orchestrator.core.persistence.write_budget import DrainBudget, StepClock, WriteBudgetConfig
from layercheck.orchestrator.core.policy_service import PolicyService
from layercheck.policies.config_loader import ConfigError
from layercheck.policies.decision import PersistDecision, StepObservation


def test_no_budget_until_every_writer_has_a_measurement():
    b = DrainBudget(WriteBudgetConfig(headroom=1.0))
    assert b.update({"a": (100, 1.0), "b": (0, 0.0)}, step_s=0.5) is None
    assert b.update({"a": (100, 1.0), "b": (300, 1.0)}, step_s=0.5) == int((100 + 300) * 0.5)


def test_budget_follows_the_bandwidth_with_headroom_ema_and_cap():
    b = DrainBudget(WriteBudgetConfig(headroom=0.5, ema=0.5))
    assert b.update({"w": (1000, 1.0)}, step_s=1.0) == 500
    # storage slows to 200 B/s: EMA 0.5 -> 600 B/s
    assert b.update({"w": (1200, 2.0)}, step_s=1.0) == 300
    # no new write since: the estimate holds
    assert b.update({"w": (1200, 2.0)}, step_s=2.0) == 600
    capped = DrainBudget(WriteBudgetConfig(headroom=1.0, cap_bytes_per_step=50))
    assert capped.update({"w": (1000, 1.0)}, step_s=1.0) == 50


def test_writers_are_keyed_by_id_join_late_and_are_forgotten_when_replaced():
    b = DrainBudget(WriteBudgetConfig(headroom=1.0, ema=0.0))
    assert b.budget_for(1.0) is None  # no writer yet
    b.observe("w0@node-a", written_bytes=1000, write_s=1.0)
    assert b.budget_for(1.0) == 1000
    b.observe("w1@node-b", written_bytes=0, write_s=0.0)  # known, not written yet: unknown bandwidth
    assert b.bandwidth is None and b.budget_for(1.0) == 1000  # the last budget holds
    b.observe("w1@node-b", written_bytes=3000, write_s=1.0)
    assert b.budget_for(2.0) == (1000 + 3000) * 2
    b.forget("w1@node-b")  # replaced (dead): its rate no longer counts
    b.observe("w1@node-b", written_bytes=9000, write_s=2.0)  # a late report of the dead writer
    assert b.writers == ("w0@node-a",) and b.budget_for(1.0) == 1000
    b.observe("w2@node-b", written_bytes=500, write_s=1.0)  # its replacement
    assert b.budget_for(1.0) == 1500


def test_totals_that_go_down_are_a_new_writer_under_the_same_id():
    b = DrainBudget(WriteBudgetConfig(headroom=1.0, ema=0.0))
    b.observe("rank0", written_bytes=1000, write_s=1.0)
    b.observe("rank0", written_bytes=0, write_s=0.0)  # the local runtime replaced the rank's writer
    b.observe("rank0", written_bytes=200, write_s=1.0)
    assert b.budget_for(1.0) == 200


def test_the_step_clock_smooths_the_intervals_and_skips_the_gap_of_a_recovery():
    clock = StepClock(ema=0.5)
    assert clock.completed(1, now=10.0) is None
    assert clock.completed(2, now=11.0) == 1.0
    assert clock.completed(4, now=16.0) == 0.5 * 1.0 + 0.5 * 2.5  # two steps in 5 s
    clock.reset()
    assert clock.completed(3, now=100.0) == 1.75  # the recovery's gap is no sample
    assert clock.completed(4, now=101.75) == 1.75


def test_config_is_validated():
    for bad in ({"headroom": 0}, {"ema": 1.0}, {"cap_bytes_per_step": 0}):
        with pytest.raises(ConfigError):
            WriteBudgetConfig(**bad)


class _Recording:
    def __init__(self) -> None:
        self.seen: list[StepObservation] = []

    def observe(self, obs: StepObservation) -> PersistDecision:
        self.seen.append(obs)
        return PersistDecision(step=obs.step)

    def rebase(self, persisted_steps) -> None:
        pass


def test_policy_service_puts_the_budget_on_the_next_observations():
    policy = _Recording()
    service = PolicyService(policy, ["a"], world_size=1)
    service.report(step=1, rank=0, lr=1.0, abs_sums={"a": 1.0}, counts={"a": 1})
    service.set_write_budget(1234)
    service.report(step=2, rank=0, lr=1.0, abs_sums={"a": 1.0}, counts={"a": 1})
    assert [o.write_budget_bytes for o in policy.seen] == [None, 1234]
    assert service.trace[-1].write_budget_bytes == 1234


def test_the_run_config_carries_the_budget_on_by_default_and_names_a_bad_field():
    from layercheck.orchestrator.core.run_config import load_run_config

    assert load_run_config("examples/demo.toml").persistence.write_budget == WriteBudgetConfig()
    assert WriteBudgetConfig().enabled
    config = load_run_config(
        "examples/demo.toml", {"persistence.write_budget": {"cap_bytes_per_step": 4096, "headroom": 0.5}}
    )
    assert config.persistence.write_budget == WriteBudgetConfig(cap_bytes_per_step=4096, headroom=0.5)
    with pytest.raises(ConfigError, match=r"persistence\.write_budget\.cap_bytes_per_step: must be None or >= 1"):
        load_run_config("examples/demo.toml", {"persistence.write_budget.cap_bytes_per_step": 0})
    with pytest.raises(ConfigError, match=r"persistence\.write_budget: unknown key"):
        load_run_config("examples/demo.toml", {"persistence.write_budget.cap": 1})
