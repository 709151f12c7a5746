"""A schedule longer than the run is legal but leaves layers at their step-0 version until the
final save: every way in says so at the start, naming the field and a value that protects them."""

import logging

import pytest

from layercheck.orchestrator.core.run_config import config_warnings, load_run_config
from layercheck.policies.configs import (
    IntervalConfig,
    LayerCheckConfig,
    NeverConfig,
    StaggeredConfig,
    schedule_warnings,
)


@pytest.mark.parametrize(
    "policy, field",
    [
        (LayerCheckConfig(), "warmup_steps = 200"),  # the paper's default warm-up in a 24-step run
        (StaggeredConfig(), "period = 100"),  # CheckpointConfig()'s default schedule
        (StaggeredConfig(period=5, warmup_steps=30), "warmup_steps = 30"),
        (IntervalConfig(interval=50), "interval = 50"),
    ],
)
def test_a_schedule_the_run_never_reaches_is_named_with_a_fix(policy, field):
    (warning,) = schedule_warnings(policy, 24, prefix="policy.")
    assert f"policy.{field} >= steps = 24" in warning and "set policy." in warning and "below 24" in warning
    assert "initial state" in warning


@pytest.mark.parametrize(
    "policy", [StaggeredConfig(period=5), LayerCheckConfig(warmup_steps=2), IntervalConfig(interval=4), NeverConfig()]
)
def test_a_schedule_that_fits_says_nothing(policy):
    assert schedule_warnings(policy, 24) == []


def test_the_run_config_warns_at_start(caplog):
    config = load_run_config("examples/demo.toml", {"steps": 24, "optim.total_steps": 24, "policy.period": 100})
    assert any("policy.period = 100 >= steps = 24" in w for w in config_warnings(config))
    assert not any("policy." in w for w in config_warnings(load_run_config("examples/demo.toml")))


def test_the_callback_warns_from_rank_0_with_the_trainers_max_steps(caplog):
    from layercheck.worker import Attachment

    class _Protocol:
        rank = 0

    attachment = Attachment.__new__(Attachment)  # (only what check_steps reads)
    attachment._policy, attachment._protocol = StaggeredConfig(), _Protocol()
    with caplog.at_level(logging.WARNING):
        found = attachment.check_steps(24)
    assert found and "StaggeredConfig.period = 100 >= steps = 24" in caplog.text
