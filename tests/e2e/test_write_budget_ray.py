"""The write budget under a real local Ray: the writers push their totals to the policy actor,
which sets the staggered schedule's budget (here bound by a small ``cap_bytes_per_step``); the
schedule stretches, and the summary reports the budget, the drain bandwidth and the peak per step."""

import pytest

from layercheck.orchestrator.runtime.driver import train
from layercheck.orchestrator.runtime.run_summary import format_summary, summarize
from layercheck.orchestrator.store.layer_store import LayerStore
from layercheck.policies.configs import StaggeredConfig
from tests.support.ray_runs import demo_config

pytestmark = pytest.mark.slow
STEPS = 16
CAP = 4096  # bytes per step: ~1/500 of the demo model's state, so the periods stretch past the run


def test_a_capped_budget_is_set_from_the_writers_and_reported(local_ray, tmp_path):
    config = demo_config(
        tmp_path,
        "budget",
        steps=STEPS,
        policy=StaggeredConfig(period=2, smax=1000),
        **{"fault.kill_at_step": 0, "persistence.write_budget.cap_bytes_per_step": CAP},
    )
    result = train(config)
    assert result.error is None, result.error
    schedule = result.schedule
    assert schedule["write_budget_enabled"] and schedule["write_budget_bytes"] == CAP
    assert schedule["drain_bytes_per_second"] > 0 and schedule["step_s"] > 0
    full = sum(result.layer_numel.values()) * 12
    summary = summarize(result)
    assert summary["write_budget_bytes_per_step"] == CAP
    assert 0 < summary["peak_step_bytes"] <= full
    text = format_summary(summary)
    assert "write budget" in text and "4.00 KiB/step" in text and "peak bytes in one step" in text
    # every layer's state is in the store (first saves, then the final save) ...
    versions = LayerStore.open(str(tmp_path / "budget")).versions()
    assert {v.layer for v in versions if v.step == STEPS} == set(result.layer_numel)
    # ... but once the budget bound, the schedule stopped re-saving: period 2 alone would save
    # every layer about STEPS / 2 times
    scheduled = [v for v in versions if v.step < STEPS]
    assert len(scheduled) <= 3 * len(result.layer_numel) < (STEPS // 2) * len(result.layer_numel) / 2
