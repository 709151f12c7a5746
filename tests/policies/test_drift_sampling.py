"""Sampled drift (``policy.drift_every``): the staggered schedule needs each layer's drift rate,
so the ranks measure drift only every few steps. Unmeasured steps are missing, never zero: the
policy service marks them, the schedule estimates them from the rate, traces record them as
null and replays fill them in. The probes' side is tested on real engines in
tests/workers/test_worker_engine_dist.py."""

from __future__ import annotations

import json

import pytest

from layercheck.orchestrator.core.policy_service import PolicyService
from layercheck.policies.checkpoint_policy import build_policy
from layercheck.policies.config_loader import ConfigError
from layercheck.policies.configs import LayerCheckConfig, StaggeredConfig, drift_measured, policy_config
from layercheck.policies.decision import StepObservation
from layercheck.policies.simulation import simulate, simulate_config
from layercheck.policies.staggered import StaggeredPolicy
from layercheck.policies.trace import DriftTrace, filled
from layercheck.workers.drift.probe import DriftSchedule

NUMEL = {"embed": 3000, "block.0": 1000, "block.1": 1000, "frozen": 2000, "lm_head": 3000}
RATES = {"embed": 4e-6, "block.0": 1e-6, "block.1": 2e-6, "frozen": 0.0, "lm_head": 3e-6}


def observations(steps: int, every: int) -> list[StepObservation]:
    """Constant rates, measured as a run with ``drift_every = every`` measures them."""
    return [
        StepObservation(step=s, lr=1e-3, drift=dict(RATES))
        if drift_measured(s, every)
        else StepObservation(step=s, lr=1e-3, measured=False)
        for s in range(1, steps + 1)
    ]


def test_the_measured_steps_are_step_one_then_every_nth():
    assert [s for s in range(1, 32) if drift_measured(s, 10)] == [1, 11, 21, 31]
    assert all(drift_measured(s, 1) for s in range(1, 50))


def test_a_schedule_arms_for_the_steps_it_measures_and_once_after_a_reset():
    schedule = DriftSchedule(3)
    assert schedule.measured(1)  # a new probe measures its first step, whichever it is
    seen = []
    for step in range(1, 11):
        seen.append(schedule.measured(step))
        schedule.arm_after(step)
    assert [s for s, m in zip(range(1, 11), seen) if m] == [1, 4, 7, 10]
    schedule.reset()  # a restore moved the weights: the next step is measured, then the grid again
    assert schedule.measured(11)
    assert not schedule.arm_after(11)  # (12 is not on the grid, 13 is)
    assert schedule.arm_after(12) and schedule.measured(13) and not schedule.measured(12)
    # a seek says which step comes next: the grid's steps only, as in a run without the failure
    schedule.reset(next_step=12)
    assert not schedule.armed and not schedule.measured(12)
    schedule.reset(next_step=13)
    assert schedule.measured(13)
    with pytest.raises(ValueError, match="drift_every"):
        DriftSchedule(0)


def test_drift_every_is_a_validated_field_of_the_staggered_schedule_only():
    assert policy_config("staggered", {"drift_every": 5}).drift_every == 5
    assert StaggeredConfig().drift_every == 10 and LayerCheckConfig().drift_every == 1
    with pytest.raises(ConfigError, match="drift_every"):
        policy_config("staggered", {"drift_every": 0})
    with pytest.raises(ConfigError, match="drift_every"):  # a threshold decides on every step's drift
        policy_config("layercheck", {"drift_every": 5})


def test_the_policy_service_marks_a_step_no_rank_measured():
    service = PolicyService(build_policy(StaggeredConfig(period=4), NUMEL), list(NUMEL), world_size=2)
    counts = {n: n_ // 2 for n, n_ in NUMEL.items()}
    service.report(step=1, rank=0, lr=1e-3, abs_sums={n: 1.0 for n in NUMEL}, counts=counts)
    service.report(step=1, rank=1, lr=1e-3, abs_sums={n: 1.0 for n in NUMEL}, counts=counts)
    for rank in (0, 1):
        service.report(step=2, rank=rank, lr=1e-3, abs_sums={}, counts=counts, measured=False)
    measured, unmeasured = service.trace
    assert measured.measured and measured.drift["embed"] == pytest.approx(2.0 / NUMEL["embed"])
    assert not unmeasured.measured and unmeasured.drift == {}


def test_the_schedule_estimates_unmeasured_steps_from_the_rate_and_never_takes_a_moving_layer_for_frozen():
    sampled = StaggeredPolicy(StaggeredConfig(period=8, drift_every=5, ema=0.9), NUMEL)
    every = StaggeredPolicy(StaggeredConfig(period=8, drift_every=1, ema=0.9), NUMEL)
    saved_sampled: dict[str, list[int]] = {n: [] for n in NUMEL}
    saved_every: dict[str, list[int]] = {n: [] for n in NUMEL}
    for a, b in zip(observations(200, 5), observations(200, 1)):
        for name in sampled.observe(a).names:
            saved_sampled[name].append(a.step)
        for name in every.observe(b).names:
            saved_every[name].append(b.step)
    # constant rates: the estimate from every fifth step is the estimate from every step
    for name, rate in RATES.items():
        assert sampled.rate[name] == pytest.approx(every.rate[name], rel=1e-6), name
        assert sampled.rate[name] == pytest.approx(rate, rel=1e-3) if rate else sampled.rate[name] == 0.0
    # so the schedules agree: every moving layer saved on its period, the frozen one only once
    assert saved_sampled == saved_every
    assert len(saved_sampled["frozen"]) == 1 and all(len(saved_sampled[n]) > 10 for n in NUMEL if n != "frozen")
    # between measurements a moving layer's unsaved drift grows by its rate
    assert all(sampled.unsaved[n] > 0 for n in NUMEL if RATES[n]) and sampled.unsaved["frozen"] == 0.0


def test_the_estimate_weighs_a_measurement_by_the_steps_it_stands_for():
    """EMA horizon in steps, however drift is sampled: a rate that changes halfway is followed at
    the same pace by a schedule measuring every step and one measuring every fifth."""
    rates = [1e-6] * 100 + [4e-6] * 100
    config = {"period": 8, "ema": 0.95}
    policies = {k: StaggeredPolicy(StaggeredConfig(**config, drift_every=k), {"block.0": 1000}) for k in (1, 5)}
    for step, rate in enumerate(rates, start=1):
        for k, policy in policies.items():
            measured = drift_measured(step, k)
            policy.observe(
                StepObservation(step=step, lr=1e-3, drift={"block.0": rate} if measured else {}, measured=measured)
            )
    assert policies[5].rate["block.0"] == pytest.approx(policies[1].rate["block.0"], rel=0.05)


def test_a_threshold_policy_refuses_a_step_with_no_drift_but_replays_an_estimate():
    policy = build_policy(LayerCheckConfig(warmup_steps=0), NUMEL)
    policy.observe(StepObservation(step=1, lr=1e-3, drift=dict(RATES)))
    with pytest.raises(ValueError, match="no drift measured"):
        policy.observe(StepObservation(step=2, lr=1e-3, measured=False))
    policy.observe(StepObservation(step=2, lr=1e-3, drift=dict(RATES), measured=False))  # a replay's estimate


def test_a_sampled_trace_records_missing_steps_as_null_and_replays_them_filled():
    trace = DriftTrace(layers=tuple(NUMEL), numel=NUMEL, steps=tuple(observations(40, 10)))
    assert trace.sampled
    data = json.loads(json.dumps(trace.to_json()))
    assert data["steps"][1]["drift"] is None and data["steps"][10]["drift"] == RATES
    for parsed in (DriftTrace.from_json(data), DriftTrace.parse(trace.to_csv())):
        assert [o.measured for o in parsed.steps] == [o.measured for o in trace.steps]
        assert parsed.steps[1].drift == {}
    full = trace.filled()
    assert all(o.drift == RATES for o in full.steps)  # constant rates: every estimate is exact
    assert [o.measured for o in full.steps] == [o.measured for o in trace.steps]  # still marked
    # a replay of the sampled run equals the replay of the same run measured every step
    every = DriftTrace(layers=tuple(NUMEL), numel=NUMEL, steps=tuple(observations(40, 1)))
    a = simulate_config(trace, StaggeredConfig(period=8, drift_every=10), label="sampled")
    b = simulate_config(every, StaggeredConfig(period=8, drift_every=1), label="every")
    assert (a.bytes_written, a.mean_unsaved_drift) == pytest.approx((b.bytes_written, b.mean_unsaved_drift))


def test_filling_takes_the_next_measurement_and_the_last_one_at_the_end():
    steps = [
        StepObservation(step=1, lr=1.0, measured=False),
        StepObservation(step=2, lr=1.0, drift={"a": 2.0}),
        StepObservation(step=3, lr=1.0, measured=False),
        StepObservation(step=4, lr=1.0, drift={"a": 4.0}),
        StepObservation(step=5, lr=1.0, measured=False),
    ]
    assert [o.drift.get("a") for o in filled(steps)] == [2.0, 2.0, 4.0, 4.0, 4.0]
    assert filled(steps[1:2]) == steps[1:2]


def test_a_layer_is_never_taken_for_frozen_before_a_measurement_said_how_fast_it_moves():
    """Step 1 at learning rate 0 (a warm-up from 0) moves nothing, frozen or not: until the next
    measurement every layer's drift is unknown, so a short period still saves every layer on time,
    as a schedule measuring every step does."""
    config = {"period": 4, "warmup_steps": 0, "ema": 0.9}
    policies = {k: StaggeredPolicy(StaggeredConfig(**config, drift_every=k), NUMEL) for k in (1, 10)}
    saved: dict[int, dict[str, list[int]]] = {k: {n: [] for n in NUMEL} for k in policies}
    for step in range(1, 31):
        lr = 0.0 if step == 1 else 1e-3
        drift = {n: 0.0 for n in NUMEL} if step == 1 else dict(RATES)
        for k, policy in policies.items():
            measured = drift_measured(step, k)
            obs = StepObservation(step=step, lr=lr, drift=drift if measured else {}, measured=measured)
            for name in policy.observe(obs).names:
                saved[k][name].append(step)
    for name in NUMEL:
        if RATES[name]:  # saved as often in steps 2..10 (before the second measurement) as when measured
            early = {k: [s for s in saved[k][name] if s <= 10] for k in policies}
            assert early[10] == early[1] and len(early[1]) >= 2, (name, early)
    # the frozen layer: once when measured every step; sampled, also while its drift was unknown
    # (the price of not knowing), and never after the measurement at step 11 said it does not move
    assert len(saved[1]["frozen"]) == 1 and saved[10]["frozen"][0] == saved[1]["frozen"][0]
    assert all(s < 11 for s in saved[10]["frozen"]), saved[10]["frozen"]


def test_between_measurements_the_unsaved_drift_grows_by_the_bias_corrected_rate():
    policy = StaggeredPolicy(StaggeredConfig(period=1000, warmup_steps=100, drift_every=10), NUMEL)
    for obs in observations(10, 10):  # one measurement (step 1), then nine steps without
        policy.observe(obs)
    for name, rate in RATES.items():  # not 2% of it, as the raw EMA after one sample would say
        assert policy.unsaved[name] == pytest.approx(10 * rate, rel=1e-9), name


def test_a_replay_shows_the_schedule_what_a_run_with_its_drift_every_would_measure():
    full = DriftTrace(layers=tuple(NUMEL), numel=NUMEL, steps=tuple(observations(40, 1)))
    seen: list[bool] = []

    class Watching(StaggeredPolicy):
        def observe(self, obs):
            seen.append(obs.measured)
            return super().observe(obs)

    config = StaggeredConfig(period=8, drift_every=10)
    simulate(full, Watching(config, NUMEL), label="what-if", drift_every=config.drift_every)
    assert [i + 1 for i, m in enumerate(seen) if m] == [1, 11, 21, 31]
