"""The failure sweep: failure points, and a tiny end-to-end sweep on real DeepSpeed ranks."""

from __future__ import annotations

import math

import pytest

from layercheck.bench.presets import preset
from layercheck.bench.strategies import default_strategies, select
from tests.support.checkout import probe

freshness = probe("freshness")  # bench/probes/freshness.py
failure_points, run_sweep, table = freshness.failure_points, freshness.run_sweep, freshness.table


def test_failure_points_start_after_a_full_period_and_leave_the_horizon():
    w = preset("tiny")  # W 40, N 50, 200 steps
    points = failure_points(w, 12, 20)
    assert len(points) == 12 and points[0] == 91 and points[-1] == 180
    with pytest.raises(ValueError, match="no room"):
        failure_points(preset("tiny", steps=100, failures=(60,)), 5, 20)


@pytest.mark.slow
def test_sweep_recovers_at_every_point_and_correlates(tmp_path):
    w = preset("tiny", steps=24, failures=(), interval=4, layercheck_warmup=4, lr_warmup=2)
    strategies = select(default_strategies(w.strategy), ["staggered", "full-resume"])[1:]
    result = run_sweep(w, strategies, points=4, horizon=3)
    points = result["points"]
    assert {p["strategy"] for p in points} == {"staggered", "full-resume"}
    assert len(points) == 2 * len(result["failure_points"])
    for p in points:
        assert all(math.isfinite(p[k]) for k in ("loss_dev_mean", "weighted_staleness", "lost_distance"))
        assert all(step <= p["t_fail"] for step in p["versions"].values())
        if p["weighted_staleness"] == 0:  # the composite is the state at t_fail: training continues exactly
            assert p["loss_dev_max"] == 0 and p["lost_distance"] == 0
    assert set(result["pooled"]) == {"weighted_staleness", "unsaved_drift", "unsaved_drift_relative", "lost_distance"}
    assert "Pearson / Spearman" in table(result)
