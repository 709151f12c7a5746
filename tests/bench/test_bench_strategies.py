"""The benchmark's strategy definitions and workload presets (pure values)."""

from __future__ import annotations

import pytest

from layercheck.bench.presets import PRESETS, Workload, preset, variant
from layercheck.bench.strategies import (
    Kind,
    Recovery,
    Strategy,
    StrategyOptions,
    Tier,
    default_strategies,
    matched_variants,
    select,
)
from layercheck.policies.configs import LayerCheckConfig, StaggeredConfig


def test_default_set_has_every_benchmark_strategy_none_first():
    names = [s.name for s in default_strategies(StrategyOptions())]
    assert names[0] == "none"
    assert set(names) == {
        "none",
        "full",
        "full-async",
        "full-resume",
        "staggered",
        "staggered@drift1",
        "layercheck",
        "layercheck-const",
        "layercheck+capture",
        "layercheck+capture+memory",
        "layercheck+capture+memory@5",
        "drift-optimal",
        "diff",
    }


def test_staggered_default_runs_at_the_baselines_period_from_the_warmup():
    by_name = {s.name: s for s in default_strategies(StrategyOptions(interval=25, layercheck_warmup=17))}
    staggered = by_name["staggered"]
    assert staggered.kind is Kind.LAYER_POLICY and staggered.policy == StaggeredConfig(period=25, warmup_steps=17)
    assert Strategy.from_json(staggered.to_json()) == staggered


def test_workload_variants_freeze_half_the_blocks_or_decay_the_lr():
    tiny = preset("tiny")
    frozen = variant(tiny, "frozen-half")
    assert frozen.freeze == ("block.0", "block.1") and frozen.name == "tiny+frozen-half"
    assert variant(tiny, "lr-decay-0.8").layer_lr_decay == 0.8
    assert variant(tiny, "default") is tiny
    assert Workload.from_json(frozen.to_json()) == frozen
    with pytest.raises(ValueError, match="unknown workload variant"):
        variant(tiny, "nope")


def test_layercheck_variants_keep_the_defaults_but_the_warmup():
    by_name = {s.name: s for s in default_strategies(StrategyOptions(layercheck_warmup=17))}
    lc, const = by_name["layercheck"].policy, by_name["layercheck-const"].policy
    defaults = LayerCheckConfig()
    assert (lc.k0, lc.k0_embed, lc.smax, lc.threshold_schedule) == (defaults.k0, defaults.k0_embed, defaults.smax, "lr")
    assert lc.warmup_steps == const.warmup_steps == 17
    assert const.threshold_schedule == "constant"


@pytest.mark.parametrize(
    "kind, recovery",
    [
        (Kind.NONE, Recovery.RESTART),
        (Kind.DEEPSPEED_SYNC, Recovery.ROLLBACK),
        (Kind.DEEPSPEED_ASYNC, Recovery.ROLLBACK),
        (Kind.LAYER_INTERVAL, Recovery.RESUME),
        (Kind.DIFFERENTIAL, Recovery.REPLAY_DELTAS),
    ],
)
def test_recovery_follows_the_kind(kind, recovery):
    assert Strategy(name="x", kind=kind, interval=5).recovery is recovery


def test_invalid_strategies_name_the_problem():
    with pytest.raises(ValueError, match="interval"):
        Strategy(name="f", kind=Kind.DEEPSPEED_SYNC)
    with pytest.raises(ValueError, match="layer-wise policy config"):
        Strategy(name="l", kind=Kind.LAYER_POLICY)
    with pytest.raises(ValueError, match="delta_density"):
        Strategy(name="d", kind=Kind.DIFFERENTIAL, interval=3, delta_density=0)


def test_json_round_trip():
    for s in default_strategies(StrategyOptions()):
        assert Strategy.from_json(s.to_json()) == s


def test_matched_variants_cover_full_full_resume_and_diff_at_both_intervals():
    variants = matched_variants(default_strategies(StrategyOptions()), staleness_interval=7, drift_interval=3)
    assert {(v.name, v.interval, v.matched) for v in variants} == {
        ("full@stal", 7, "staleness"),
        ("full@drift", 3, "drift"),
        ("full-resume@stal", 7, "staleness"),
        ("full-resume@drift", 3, "drift"),
        ("diff@stal", 7, "staleness"),
        ("diff@drift", 3, "drift"),
    }


def test_byte_matched_variants_are_the_full_checkpoint_baselines_at_their_own_interval():
    variants = matched_variants(
        default_strategies(StrategyOptions()),
        staleness_interval=7,
        drift_interval=3,
        bytes_intervals={"full": 9, "full-resume": 4, "diff": 2},
    )
    at_bytes = {(v.name, v.kind, v.interval) for v in variants if v.matched == "bytes"}
    # diff writes per-step deltas: its bytes are no multiple of one checkpoint, it has no @bytes
    assert at_bytes == {("full@bytes", Kind.DEEPSPEED_SYNC, 9), ("full-resume@bytes", Kind.LAYER_INTERVAL, 4)}
    assert len(variants) == 8  # and the six freshness-matched ones
    assert Strategy.from_json(variants[2].to_json()) == variants[2]
    with pytest.raises(ValueError, match="matched"):
        Strategy(name="f", kind=Kind.DEEPSPEED_SYNC, interval=3, matched="time")


def test_select_keeps_none_first_and_rejects_unknown_names():
    chosen = select(default_strategies(StrategyOptions()), ["layercheck", "full"])
    assert [s.name for s in chosen] == ["none", "layercheck", "full"]
    with pytest.raises(ValueError, match="unknown"):
        select(default_strategies(StrategyOptions()), ["nope"])


def test_presets_round_trip_and_validate():
    for w in PRESETS.values():
        assert Workload.from_json(w.to_json()) == w
    assert preset("tiny", steps=30, failures=(10, 20), interval=4, layercheck_warmup=5).strategy.interval == 4
    with pytest.raises(ValueError, match="failures"):
        preset("tiny", failures=(500,))
    with pytest.raises(ValueError, match="unknown preset"):
        preset("nope")


def test_capture_is_a_tier_of_the_paper_policy_and_only_of_resuming_strategies():
    by_name = {s.name: s for s in default_strategies(StrategyOptions())}
    captured, plain = by_name["layercheck+capture"], by_name["layercheck"]
    assert captured.capture and not plain.capture
    assert captured.policy == plain.policy and captured.tiers == (Tier.CAPTURE,)
    assert Strategy.from_json(captured.to_json()) == captured
    with pytest.raises(ValueError, match="tiers need a resuming strategy"):
        Strategy(name="full+capture", kind=Kind.DEEPSPEED_SYNC, interval=5, tiers=(Tier.CAPTURE,))
    with pytest.raises(ValueError, match="distinct"):
        Strategy(name="x", kind=Kind.LAYER_INTERVAL, interval=5, tiers=(Tier.CAPTURE, Tier.CAPTURE))


def test_the_memory_tier_rides_on_capture_and_sets_the_writers_budget():
    from layercheck.bench.runner import coordinator_options
    from layercheck.orchestrator.core.persistence.config import PersistenceConfig

    by_name = {s.name: s for s in default_strategies(StrategyOptions())}
    memory, captured = by_name["layercheck+capture+memory"], by_name["layercheck+capture"]
    assert memory.memory and memory.capture and not captured.memory
    assert memory.policy == captured.policy and memory.tiers == (Tier.CAPTURE, Tier.MEMORY)
    assert Strategy.from_json(memory.to_json()) == memory
    budget = PersistenceConfig().memory_bytes
    assert coordinator_options(memory) == {"capture": True, "memory_bytes": budget, "memory_period": 0}
    assert coordinator_options(captured) == {"capture": True, "memory_bytes": 0, "memory_period": 0}
    versions = by_name["layercheck+capture+memory@5"]
    assert versions.memory_period == 5 and Strategy.from_json(versions.to_json()) == versions
    assert coordinator_options(versions) == {"capture": True, "memory_bytes": budget, "memory_period": 5}
    with pytest.raises(ValueError, match="memory_period needs the memory tier"):
        Strategy(name="x", kind=Kind.LAYER_POLICY, policy=memory.policy, tiers=(Tier.CAPTURE,), memory_period=5)
