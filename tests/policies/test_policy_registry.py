"""The policy registry: a name gives a config class, a config class gives a policy class, and
what callers need of a policy (its metrics view, its label, whether it is selective) is asked of
it, never switched on its type."""

import json

import pytest

from layercheck.policies.checkpoint_policy import POLICY_TYPES, build_policy, policy_type
from layercheck.policies.config_loader import ConfigError
from layercheck.policies.configs import POLICY_CONFIGS, policy_config, policy_name
from layercheck.policies.decision import StepObservation

NUMEL = {"embed": 40, "block.0": 10, "block.1": 10, "norm": 1, "lm_head": 40}


def test_both_halves_of_the_registry_cover_the_same_policies():
    assert set(POLICY_TYPES) == set(POLICY_CONFIGS.values())
    for name, config_type in POLICY_CONFIGS.items():
        assert policy_type(name).config_type is config_type


@pytest.mark.parametrize("name", sorted(POLICY_CONFIGS))
def test_every_registered_name_round_trips_config_policy_and_state(name):
    config = policy_config(name)
    assert policy_name(config) == name
    policy = build_policy(config, NUMEL)
    assert isinstance(policy, policy_type(name))
    for step in range(1, 260):
        policy.observe(StepObservation(step=step, lr=1e-4, drift={layer: 1e-4 for layer in NUMEL}))
    state = json.loads(json.dumps(policy.state_dict()))  # plain JSON, as a recovered run stores it
    again = build_policy(policy_config(name), NUMEL)
    again.load_state_dict(state)
    assert again.state_dict() == policy.state_dict()
    later = StepObservation(step=260, lr=1e-4, drift={layer: 1e-2 for layer in NUMEL})
    assert again.observe(later) == policy.observe(later)
    view = policy.metrics_view(1e-4)
    assert set(view) <= {"smax", "accumulated", "threshold"}
    json.dumps(view)


def test_an_unknown_name_is_a_config_error_listing_the_known_ones():
    for call in (lambda: policy_config("sometimes"), lambda: policy_type("sometimes")):
        with pytest.raises(ConfigError, match="policy.name") as info:
            call()
        assert all(name in str(info.value) for name in POLICY_CONFIGS)


def test_a_non_config_is_refused():
    with pytest.raises(TypeError, match="not a policy config"):
        build_policy({"name": "layercheck"}, NUMEL)


def test_metrics_views_keep_the_shape_the_exporter_reads():
    lc = build_policy(policy_config("layercheck", {"warmup_steps": 0, "smax": 7}), NUMEL)
    lc.observe(StepObservation(step=0, lr=1e-3, drift={}))
    lc.observe(StepObservation(step=1, lr=1e-3, drift={"block.0": 2e-4}))
    view = lc.metrics_view(1e-3)
    assert view["smax"] == 7 and view["accumulated"]["block.0"] == pytest.approx(2e-4)
    assert view["threshold"] == {name: pytest.approx(1e-2 if name == "embed" else 1e-3) for name in NUMEL}
    assert build_policy(policy_config("interval", {"interval": 25}), NUMEL).metrics_view(1e-3) == {"smax": 25}
    assert build_policy(policy_config("never"), NUMEL).metrics_view(1e-3) == {}


def test_configs_say_whether_they_are_selective_and_how_they_are_labelled():
    selective = {name for name, cls in POLICY_CONFIGS.items() if cls.selective}
    assert selective == {"staggered", "layercheck", "drift-optimal"}
    for name in selective:
        assert policy_config(name).warmup_steps >= 0  # what the comparison evaluates from
    assert policy_config("layercheck", {"k0": 2e-3}).describe() == "layercheck k0=0.002"
    assert policy_config("drift-optimal", {"period": 20}).describe() == "drift-optimal period=20"
    assert policy_config("staggered", {"period": 50}).describe() == "staggered period=50"
    assert policy_config("interval").describe() == "interval" and policy_config("never").describe() == "never"
