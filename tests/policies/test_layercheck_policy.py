import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from layercheck.policies.checkpoint_policy import IntervalPolicy, LayerCheckPolicy, NeverPolicy, build_policy
from layercheck.policies.config_loader import ConfigError
from layercheck.policies.configs import IntervalConfig, LayerCheckConfig, NeverConfig, policy_config
from layercheck.policies.decision import PersistDecision, Reason, StepObservation

LAYERS = ("embed", "block.0", "block.1", "norm", "lm_head")


def obs(step, lr=1.0, drift=0.0, **per_layer):
    values = {name: drift for name in LAYERS}
    values.update({k.replace("_", "."): v for k, v in per_layer.items()})
    return StepObservation(step=step, lr=lr, drift=values)


def policy(**overrides):
    defaults = dict(k0=1.0, k0_embed=10.0, smax=1000, warmup_steps=3, threshold_schedule="constant")
    return LayerCheckPolicy(LayerCheckConfig(**{**defaults, **overrides}), LAYERS)


def test_nothing_before_warmup_then_base_of_every_layer_at_w():
    p = policy(warmup_steps=3)
    assert not p.observe(obs(1, drift=100.0))
    assert not p.observe(obs(2, drift=100.0))
    base = p.observe(obs(3, drift=100.0))
    assert base.names == LAYERS and set(base.reasons.values()) == {Reason.BASE}
    assert base.is_base
    assert p.base_step == 3 and p.accumulated == {n: 0.0 for n in LAYERS}


def test_zero_warmup_writes_base_at_first_step():
    p = policy(warmup_steps=0)
    assert p.observe(obs(1)).is_base


def test_drift_accumulates_and_resets_on_persist():
    p = policy(warmup_steps=0, k0=1.0)
    p.observe(obs(1))  # base
    assert not p.observe(obs(2, block_0=0.6))
    assert p.accumulated["block.0"] == pytest.approx(0.6)
    decision = p.observe(obs(3, block_0=0.5))
    assert decision.reasons == {"block.0": Reason.DRIFT}
    assert p.accumulated["block.0"] == 0.0 and p.last_persisted["block.0"] == 3
    assert not p.observe(obs(4, block_0=0.5))
    assert p.accumulated["block.0"] == pytest.approx(0.5)


def test_embeddings_use_their_own_k0():
    p = policy(warmup_steps=0, k0=1.0, k0_embed=10.0)
    p.observe(obs(1))
    decision = p.observe(obs(2, embed=5.0, block_1=5.0))
    assert decision.reasons == {"block.1": Reason.DRIFT}
    assert p.observe(obs(3, embed=5.0)).reasons == {"embed": Reason.DRIFT}


def test_staleness_guard_persists_a_quiet_layer_at_smax():
    p = policy(warmup_steps=0, smax=5)
    p.observe(obs(1))
    for step in range(2, 6):
        assert not p.observe(obs(step))
    decision = p.observe(obs(6))
    assert decision.names == LAYERS and set(decision.reasons.values()) == {Reason.STALENESS}


def test_lr_schedule_scales_the_threshold():
    p = policy(warmup_steps=0, threshold_schedule="lr", lr_peak=1e-4, k0=1e-3, k0_embed=1e-2, min_lr_scale=0.01)
    assert p.threshold("block.0", 1e-4) == pytest.approx(1e-3)
    assert p.threshold("block.0", 5e-5) == pytest.approx(5e-4)  # decay halves the threshold
    assert p.threshold("embed", 5e-5) == pytest.approx(5e-3)
    assert p.threshold("block.0", 0.0) == pytest.approx(1e-5)  # floored, never zero
    assert p.threshold("block.0", 1e-9) == pytest.approx(1e-5)


def test_lr_schedule_without_peak_uses_largest_lr_seen():
    p = policy(warmup_steps=0, threshold_schedule="lr", k0=1.0)
    p.observe(obs(1, lr=2.0))
    p.observe(obs(2, lr=4.0))  # warm-up ramps the peak up
    assert p.lr_scale(1.0) == pytest.approx(0.25)
    assert p.lr_scale(8.0) == pytest.approx(1.0)


def test_warmup_ramp_does_not_flood_saves():
    """A layer whose drift tracks the LR is persisted at nearly the same pace during warm-up,
    at the peak and after a 4x decay: the threshold follows the schedule. (During the ramp the
    threshold is set by the current, larger LR, so saves there come a little later.)"""
    peak = 1e-3
    p = LayerCheckPolicy(LayerCheckConfig(k0=10 * peak, warmup_steps=0, lr_peak=peak), ["block.0"])
    saves = []
    for step in range(1, 301):
        lr = peak * min(step / 100, 1.0) * (1.0 if step <= 200 else 0.25)
        if p.observe(StepObservation(step=step, lr=lr, drift={"block.0": lr})).reasons.get("block.0") is Reason.DRIFT:
            saves.append(step)
    gaps = [b - a for a, b in zip(saves, saves[1:])]
    assert all(10 <= gap <= 13 for gap in gaps)
    assert {b - a for a, b in zip(saves, saves[1:]) if a > 100} == {10}


def test_constant_schedule_ignores_lr():
    p = policy(threshold_schedule="constant", k0=2.0)
    assert p.threshold("block.0", 1e-9) == p.threshold("block.0", 1.0) == 2.0


def test_unknown_layer_in_drift_is_refused():
    with pytest.raises(ValueError, match="unknown layers"):
        policy().observe(StepObservation(step=1, lr=1.0, drift={"block.9": 1.0}))


@settings(max_examples=60, deadline=None)
@given(
    smax=st.integers(min_value=1, max_value=40),
    warmup=st.integers(min_value=0, max_value=20),
    drifts=st.lists(
        st.lists(st.floats(min_value=0, max_value=3), min_size=len(LAYERS), max_size=len(LAYERS)),
        min_size=1,
        max_size=150,
    ),
    lrs=st.lists(st.floats(min_value=0, max_value=1e-3), min_size=1, max_size=150),
    schedule=st.sampled_from(["lr", "constant"]),
)
def test_properties_staleness_bound_and_reset(smax, warmup, drifts, lrs, schedule):
    p = LayerCheckPolicy(
        LayerCheckConfig(k0=1.0, k0_embed=2.0, smax=smax, warmup_steps=warmup, threshold_schedule=schedule), LAYERS
    )
    for i, row in enumerate(drifts):
        step = i + 1
        before = dict(p.accumulated)
        decision = p.observe(StepObservation(step=step, lr=lrs[i % len(lrs)], drift=dict(zip(LAYERS, row))))
        assert decision.step == step
        if step < warmup:
            assert not decision and p.base_step is None
            continue
        for name in LAYERS:
            staleness = step - p.last_persisted[name]
            assert 0 <= staleness < smax  # after the decision; it reached smax at most just before
            if name in decision.names:
                assert p.accumulated[name] == 0.0 and p.last_persisted[name] == step
            elif p.base_step != step:
                assert p.accumulated[name] == pytest.approx(before[name] + row[LAYERS.index(name)])
                assert p.accumulated[name] < p.threshold(name, lrs[i % len(lrs)])


@settings(max_examples=40, deadline=None)
@given(
    split=st.integers(min_value=1, max_value=60),
    drifts=st.lists(st.floats(min_value=0, max_value=2), min_size=61 * len(LAYERS), max_size=61 * len(LAYERS)),
)
def test_state_export_restore_gives_identical_future_decisions(split, drifts):
    config = LayerCheckConfig(k0=1.0, k0_embed=3.0, smax=7, warmup_steps=5, threshold_schedule="lr")
    steps = [
        StepObservation(step=s + 1, lr=1e-4 * (1 + (s % 13)), drift=dict(zip(LAYERS, drifts[s * 5 : (s + 1) * 5])))
        for s in range(61)
    ]
    original = LayerCheckPolicy(config, LAYERS)
    for o in steps[:split]:
        original.observe(o)
    import json

    restored = LayerCheckPolicy(config, LAYERS)
    restored.load_state_dict(json.loads(json.dumps(original.state_dict())))
    for o in steps[split:]:
        assert restored.observe(o) == original.observe(o)


def test_state_for_other_layers_is_refused():
    with pytest.raises(ValueError, match="policy state is for layers"):
        policy().load_state_dict(LayerCheckPolicy(LayerCheckConfig(), ["x"]).state_dict())


def test_interval_and_never_baselines_share_the_interface():
    numel = dict.fromkeys(LAYERS, 1)
    interval = build_policy(IntervalConfig(interval=3), numel)
    decisions = [interval.observe(obs(s)) for s in range(1, 8)]
    assert [d.step for d in decisions if d] == [3, 6]
    assert decisions[2].names == LAYERS and set(decisions[2].reasons.values()) == {Reason.INTERVAL}
    never = build_policy(NeverConfig(), numel)
    assert not any(never.observe(obs(s, drift=1e9)) for s in range(1, 50))
    assert isinstance(interval, IntervalPolicy) and isinstance(never, NeverPolicy)
    for p in (interval, never):
        p.load_state_dict(p.state_dict())
        p.rebase({})


def test_decision_json_round_trip():
    d = PersistDecision.of(7, {"embed": Reason.DRIFT, "norm": Reason.STALENESS})
    assert PersistDecision.from_json(d.to_json()) == d


@pytest.mark.parametrize(
    "name,params,field",
    [
        ("layercheck", {"k0": -1e-3}, "policy.k0"),
        ("layercheck", {"k0": 0}, "policy.k0"),
        ("layercheck", {"k0_embed": -1}, "policy.k0_embed"),
        ("layercheck", {"smax": 0}, "policy.smax"),
        ("layercheck", {"warmup_steps": -1}, "policy.warmup_steps"),
        ("layercheck", {"threshold_schedule": "cosine"}, "policy.threshold_schedule"),
        ("layercheck", {"lr_peak": 0}, "policy.lr_peak"),
        ("layercheck", {"smax": 1.5}, "policy.smax"),
        ("layercheck", {"k_zero": 1}, "unknown key"),
        ("interval", {"interval": 0}, "policy.interval"),
        ("sometimes", {}, "policy.name"),
    ],
)
def test_bad_config_names_the_field(name, params, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        policy_config(name, params)


def test_good_config_parses_with_defaults():
    config = policy_config("layercheck", {"k0": 2e-3})
    assert config == LayerCheckConfig(k0=2e-3)
    assert config.k0_embed == 1e-2 and config.smax == 1000 and config.warmup_steps == 200
    assert math.isclose(LayerCheckConfig().k0, 1e-3)
