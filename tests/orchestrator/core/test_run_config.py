"""The run config (``layercheck.orchestrator.core.run_config``): the example configs load, a bad
value (``inf``, ``nan`` too) is an error naming its field, the test-only ``[fault]`` keys refused
by name (a store's ``run.json`` from before they went still reads), relative storage made
absolute for the workers."""

import math
from pathlib import Path

import pytest

from layercheck.orchestrator.core.run_config import REMOVED_FAULT_KEYS, load_run_config, parse_run_config
from layercheck.policies.config_loader import ConfigError


def test_example_configs_load_and_bad_values_name_the_field(tmp_path):
    config = load_run_config("examples/demo.toml")
    assert config.engine.zero_stage == 3 and config.cluster.num_workers == 2 and config.fault.kill_at_step > 0
    assert parse_run_config(config.to_json()) == config  # what the workers receive
    for overrides, field in [
        ({"policy.period": -1}, "policy.period"),
        ({"engine.zero_stage": 7}, "zero_stage"),
        ({"stepz": 3}, "stepz"),
        ({"policy.ema": float("inf")}, "policy.ema"),
        ({"policy.k0": 1e-3}, "policy: unknown key"),  # the demo's staggered schedule has no threshold
        ({"policy.name": "sometimes"}, "policy.name"),
        ({"cluster.max_failures": -1}, "max_failures"),
        ({"fault.kill_at_step": -1}, "fault.kill_at_step"),
    ]:
        with pytest.raises(ConfigError, match=field):
            load_run_config("examples/demo.toml", overrides)
    (tmp_path / "x.yaml").write_text("steps: 5\nmodel: {hf_config: {model_type: llama}}\npolicy: {name: never}\n")
    assert load_run_config(tmp_path / "x.yaml").policy_name == "never"
    with pytest.raises(ConfigError, match="model"):
        parse_run_config({"steps": 3})
    with pytest.raises(ConfigError, match="cannot read"):
        load_run_config(tmp_path / "missing.toml")
    assert math.isfinite(config.optim.lr)


@pytest.mark.parametrize("key", sorted(REMOVED_FAULT_KEYS))
def test_a_removed_test_only_fault_key_is_refused_by_name(key):
    """The eight test-only ``[fault]`` keys are gone (tests/support/faults.py injects those failures);
    a config that names one, even at its old default, says so in one line."""
    with pytest.raises(ConfigError, match=rf"^fault\.{key}: gone; it was test-only .*LAYERCHECK_FAULTS[^\n]*$"):
        load_run_config("examples/demo.toml", {f"fault.{key}": REMOVED_FAULT_KEYS[key]})
    stored = load_run_config("examples/demo.toml").to_json()
    assert set(stored["fault"]) == {"kill_at_step", "kill_rank"}
    # a store's run.json from before: every key at its old default, read as the rehearsal alone
    old = {**stored, "fault": {**stored["fault"], **REMOVED_FAULT_KEYS}}
    assert parse_run_config(old).fault == parse_run_config(stored).fault
    with pytest.raises(ConfigError, match=f"fault.{key}: gone"):
        parse_run_config({**stored, "fault": {**stored["fault"], key: "not the default"}})


def test_relative_storage_is_made_absolute_for_the_workers(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = load_run_config(Path(__file__).resolve().parents[3] / "examples/demo.toml")
    assert config.storage_uri == "runs/demo"
    assert config.with_absolute_storage().storage_uri == str(tmp_path / "runs/demo")
    remote = parse_run_config({**config.to_json(), "storage": "s3://bucket/run"})
    assert remote.with_absolute_storage().storage_uri == "s3://bucket/run"


def test_memory_versions_need_the_memory_tier():
    from layercheck.orchestrator.core.persistence.config import PersistenceConfig

    assert PersistenceConfig(memory_period=5).memory_period == 5
    with pytest.raises(ConfigError, match=r"memory_period: must be 0 while memory_bytes is 0"):
        PersistenceConfig(memory_period=5, memory_bytes=0)
    with pytest.raises(ConfigError, match=r'memory_period: must be "auto" or an integer >= 0'):
        PersistenceConfig(memory_period=-1)
    with pytest.raises(ConfigError, match=r'memory_period: must be "auto" or an integer >= 0'):
        PersistenceConfig(memory_period="often")  # type: ignore[arg-type]
    # the default: chosen by the run, off where there is no memory tier (no error: nothing was set)
    assert PersistenceConfig().memory_period == "auto" == PersistenceConfig(memory_bytes=0).memory_period
    assert PersistenceConfig().memory_period_at_start == 0  # the ranks follow the decisions' period
    assert PersistenceConfig(memory_period=5).memory_period_at_start == 5
