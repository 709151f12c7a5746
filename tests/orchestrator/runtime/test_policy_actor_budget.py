"""The Ray policy actor's write budget follows the totals its writers push and the step time it
observes; it keeps the run's peak bytes per step. The actor's class, driven without Ray (its
``report`` is a coroutine; one rank completes each step at once)."""

from __future__ import annotations

import asyncio

import pytest

from layercheck.orchestrator.core.persistence.write_budget import WriteBudgetConfig
from layercheck.orchestrator.core.policy_service import DECISION_HISTORY
from layercheck.orchestrator.runtime import policy_actor
from layercheck.policies.configs import IntervalConfig, StaggeredConfig
from tests.support.clock import ManualClock

NUMEL = {"embed": 100, "block.0": 50, "norm": 10}
#: (drift every step: each step's news reaches the next observation; quiet steps: tests/orchestrator/runtime/test_quiet_steps.py)


@pytest.fixture
def clock(monkeypatch):
    fake = ManualClock()
    monkeypatch.setattr(policy_actor.time, "monotonic", fake)
    return fake


def actor(policy, write_budget=None):
    return policy_actor.PolicyActor.__ray_actor_class__(policy, NUMEL, 1, 2, write_budget)


def step(a, clock, t: int, at: float):
    clock.now = at
    return asyncio.run(a.report(t, 0, 1.0, {name: 1e-3 * size for name, size in NUMEL.items()}, NUMEL))


def test_the_budget_follows_the_writers_totals_and_the_observed_step_time(clock):
    a = actor(StaggeredConfig(period=4, drift_every=1), WriteBudgetConfig(headroom=1.0, ema=0.0))
    step(a, clock, 1, at=0.0)
    assert a.schedule_view()["write_budget_bytes"] is None  # no write yet, no step time
    a.writer_totals("writer-0@node-a", 1000, 1.0)  # 1000 B/s
    step(a, clock, 2, at=0.5)  # steps take 0.5 s
    assert a.service.write_budget_bytes == 500
    step(a, clock, 3, at=1.0)
    assert a.service.trace[-1].write_budget_bytes == 500  # carried on the next observation
    a.writer_totals("writer-0@node-a", 1100, 2.0)  # storage slowed to 100 B/s
    assert a.service.write_budget_bytes == 50
    a.forget_writers(["writer-0@node-a"])  # replaced; its successor drains 4000 B/s
    a.writer_totals("writer-1@node-a", 4000, 1.0)
    view = a.schedule_view()
    assert view["write_budget_bytes"] == 2000 and view["drain_bytes_per_second"] == 4000.0
    assert view["step_s"] == 0.5 and view["write_budget_enabled"]


def test_a_cap_bounds_the_budget_and_a_recovery_gap_is_no_step_time(clock):
    a = actor(
        StaggeredConfig(period=4, drift_every=1), WriteBudgetConfig(headroom=1.0, ema=0.0, cap_bytes_per_step=300)
    )
    a.writer_totals("w", 10_000, 1.0)
    step(a, clock, 1, at=0.0)
    step(a, clock, 2, at=1.0)
    assert a.service.write_budget_bytes == 300
    a.restart(1, 2, {})
    step(a, clock, 3, at=60.0)  # the first step after the recovery: no sample across the gap
    assert a.schedule_view()["step_s"] == 1.0


def test_disabled_or_absent_the_budget_stays_unset(clock):
    for budget in (None, WriteBudgetConfig(enabled=False)):
        a = actor(StaggeredConfig(period=4, drift_every=1), budget)
        a.writer_totals("w", 1000, 1.0)
        step(a, clock, 1, at=0.0)
        step(a, clock, 2, at=1.0)
        assert a.service.write_budget_bytes is None and not a.schedule_view()["write_budget_enabled"]


def test_the_peak_is_the_most_bytes_one_decision_handed_over(clock):
    a = actor(IntervalConfig(interval=2))
    decisions = [step(a, clock, t, at=float(t)) for t in range(1, 5)]
    assert [bool(d["layers"]) for d in decisions] == [False, True, False, True]
    view = a.schedule_view()
    assert view["peak_step_bytes"] == sum(NUMEL.values()) * 12 and view["peak_step"] == 2
    assert view["handed_bytes"] == 2 * sum(NUMEL.values()) * 12
    step(a, clock, 4, at=9.0)  # a late duplicate of a completed step counts nothing again
    assert a.schedule_view()["peak_step"] == 2


def test_a_rank_reporting_a_step_long_past_fails_instead_of_waiting_for_ever(clock):
    """A rank that resumed at another step than its group (once: a grown group's new rank got the
    old attempt's resume step) must fail its group, not wait for a decision no one will make."""
    a = actor(StaggeredConfig(period=4, drift_every=1))
    last = DECISION_HISTORY + 2
    for t in range(1, last + 1):
        step(a, clock, t, at=float(t))
    assert step(a, clock, last, at=float(last)) is not None  # a retried call still gets its decision
    with pytest.raises(RuntimeError, match=f"reported step 1, but the run completed step {last}"):
        step(a, clock, 1, at=float(last))
