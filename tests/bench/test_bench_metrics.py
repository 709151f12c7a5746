"""Benchmark metric formulas: staleness, unsaved drift, loss deviation, ETTR, matched intervals."""

from __future__ import annotations

import pytest

from layercheck.bench.formulas import (
    FreshnessTracker,
    loss_deviation,
    matched_intervals,
    measured_ettr,
    post_failure_windows,
    trace_of,
)
from layercheck.policies.configs import IntervalConfig
from layercheck.policies.simulation import simulate_config


def test_tracker_weights_staleness_by_parameters():
    t = FreshnessTracker(numel={"a": 3, "b": 1})
    t.observe(1, {"a": 1.0, "b": 1.0}, persisted=["a"])
    t.observe(2, {"a": 1.0, "b": 2.0}, persisted=[])
    # step 1: a=0, b=1 -> 0.25; step 2: a=1, b=2 -> 1.25
    assert t.weighted == pytest.approx([0.25, 1.25])
    assert t.unsaved_series == pytest.approx([0.25, (3 * 1.0 + 1 * 3.0) / 4])
    assert t.max_staleness == 2
    assert t.weighted_staleness_now(4) == pytest.approx((3 * 3 + 4) / 4)


def test_tracker_matches_the_simulator_on_a_trace():
    numel = {"x": 10, "y": 30}
    drifts = {s: {"x": 0.1 * s, "y": 0.05} for s in range(1, 41)}
    trace = trace_of(numel, drifts, {s: 1e-3 for s in drifts})
    sim = simulate_config(trace, IntervalConfig(interval=7), label="i", eval_from=5)
    t = FreshnessTracker(numel=numel, eval_from=5)
    for s in range(1, 41):
        t.observe(s, drifts[s], ["x", "y"] if s % 7 == 0 else [])
    assert t.summary()["mean_weighted_staleness"] == pytest.approx(sim.mean_weighted_staleness)
    assert t.summary()["mean_unsaved_drift"] == pytest.approx(sim.mean_unsaved_drift)
    assert t.summary()["max_staleness"] == sim.max_staleness


def test_loss_deviation_over_windows():
    ref = {1: 2.0, 2: 2.0, 3: 2.0, 4: 2.0}
    run = {1: 2.0, 2: 2.5, 3: 1.0, 4: 2.0}
    d = loss_deviation(run, ref, [(2, 3)])
    assert d["mean"] == pytest.approx(0.75) and d["max"] == pytest.approx(1.0)
    assert d["max_relative"] == pytest.approx(0.5) and d["steps"] == 2


def test_post_failure_windows_run_to_the_next_failure():
    assert post_failure_windows([10, 20], 30) == [(11, 20), (21, 30)]
    assert post_failure_windows([10, 20], 30, length=5) == [(11, 15), (21, 25)]


def test_measured_ettr():
    assert measured_ettr(productive_s=90, train_s=95, recovery_s=3, restart_s=1, failures=2) == pytest.approx(0.9)


def test_matched_intervals_bracket_the_target():
    numel = {"x": 1}
    drifts = {s: {"x": 1.0} for s in range(1, 101)}
    trace = trace_of(numel, drifts, {s: 1.0 for s in drifts})
    m = matched_intervals(trace, target_staleness=4.5, target_drift=4.5, eval_from=0)
    # every-N checkpoints have mean staleness ~(N-1)/2: 4.5 -> N=10
    assert m.staleness == 10 and m.drift == 10
