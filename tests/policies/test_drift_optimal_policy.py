"""The drift-optimal policy: per-layer save period ~ 1/sqrt(drift rate), mean-rate layer every `period`."""

from __future__ import annotations

import pytest

from layercheck.policies.checkpoint_policy import DriftOptimalPolicy, build_policy
from layercheck.policies.config_loader import ConfigError
from layercheck.policies.configs import DriftOptimalConfig, policy_config, policy_name
from layercheck.policies.decision import StepObservation


def _run(policy: DriftOptimalPolicy, drift: dict[str, float], steps: int) -> dict[str, list[int]]:
    saved: dict[str, list[int]] = {name: [] for name in drift}
    for step in range(1, steps + 1):
        for name in policy.observe(StepObservation(step=step, lr=1.0, drift=drift)).names:
            saved[name].append(step)
    return saved


def test_base_at_warmup_then_periods_follow_one_over_sqrt_drift():
    # equal sizes, rates 4 and 1 (mean 2.5): periods 10 * sqrt(2.5/4) ~ 7.9 and 10 * sqrt(2.5) ~ 15.8
    policy = DriftOptimalPolicy(DriftOptimalConfig(period=10, warmup_steps=5, ema=0.0), {"fast": 100, "slow": 100})
    saved = _run(policy, {"fast": 4.0, "slow": 1.0}, 200)
    assert saved["fast"][0] == saved["slow"][0] == 5
    fast = (saved["fast"][-1] - saved["fast"][1]) / (len(saved["fast"]) - 2)
    slow = (saved["slow"][-1] - saved["slow"][1]) / (len(saved["slow"]) - 2)
    assert fast == pytest.approx(8, abs=0.5) and slow == pytest.approx(16, abs=0.5)


def test_layers_at_the_mean_rate_are_saved_every_period():
    policy = DriftOptimalPolicy(DriftOptimalConfig(period=7, warmup_steps=0, ema=0.0), {"a": 3, "b": 5})
    saved = _run(policy, {"a": 0.5, "b": 0.5}, 50)
    assert saved["a"] == saved["b"] == [1, 8, 15, 22, 29, 36, 43, 50]


def test_staleness_backstop_and_state_round_trip():
    policy = DriftOptimalPolicy(DriftOptimalConfig(period=10, warmup_steps=0, smax=4, ema=0.0), {"a": 1, "idle": 1})
    saved = _run(policy, {"a": 1.0, "idle": 0.0}, 9)
    assert saved["idle"] == [1, 5, 9]
    twin = DriftOptimalPolicy(policy.config, {"a": 1, "idle": 1})
    twin.load_state_dict(policy.state_dict())
    obs = StepObservation(step=10, lr=1.0, drift={"a": 1.0, "idle": 0.0})
    assert twin.observe(obs) == policy.observe(obs)


def test_config_validation_and_registration():
    with pytest.raises(ConfigError, match="policy.period"):
        policy_config("drift-optimal", {"period": 0})
    with pytest.raises(ConfigError, match="policy.ema"):
        policy_config("drift-optimal", {"ema": 1.0})
    config = policy_config("drift-optimal", {"period": 20})
    assert config == DriftOptimalConfig(period=20) and policy_name(config) == "drift-optimal"
    assert isinstance(build_policy(config, {"a": 1}), DriftOptimalPolicy)


def test_rebase_counts_from_the_loaded_versions():
    policy = DriftOptimalPolicy(DriftOptimalConfig(period=10, warmup_steps=0, smax=3, ema=0.0), {"a": 1, "b": 1})
    _run(policy, {"a": 0.0, "b": 0.0}, 2)
    policy.rebase({"a": 1})  # b's versions were lost: the base is written again
    assert policy.base_step is None and policy.accumulated == {"a": 0.0, "b": 0.0}
    assert policy.observe(StepObservation(step=3, lr=1.0, drift={"a": 0.0, "b": 0.0})).is_base
