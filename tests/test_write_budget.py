"""The write budget from the writers' drain bandwidth (pure)."""

from __future__ import annotations

import pytest

from orchestrator.core.policy_service import PolicyService
from orchestrator.core.write_budget import DrainBudget, WriteBudgetConfig
from policies.config_loader import ConfigError
from policies.decision import PersistDecision, StepObservation


def test_no_budget_until_every_writer_has_a_measurement():
    b = DrainBudget(WriteBudgetConfig(headroom=1.0), writers=2)
    assert b.update(written_bytes=[100, 0], write_s=[1.0, 0.0], step_s=0.5) is None
    assert b.update(written_bytes=[100, 300], write_s=[1.0, 1.0], step_s=0.5) == int((100 + 300) * 0.5)


def test_budget_follows_the_bandwidth_with_headroom_ema_and_cap():
    b = DrainBudget(WriteBudgetConfig(headroom=0.5, ema=0.5), writers=1)
    assert b.update(written_bytes=[1000], write_s=[1.0], step_s=1.0) == 500
    # storage slows to 200 B/s: EMA 0.5 -> 600 B/s
    assert b.update(written_bytes=[1200], write_s=[2.0], step_s=1.0) == 300
    # no new write since: the estimate holds
    assert b.update(written_bytes=[1200], write_s=[2.0], step_s=2.0) == 600
    capped = DrainBudget(WriteBudgetConfig(headroom=1.0, cap_bytes_per_step=50), writers=1)
    assert capped.update(written_bytes=[1000], write_s=[1.0], step_s=1.0) == 50


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
