"""Freshness measures and the correlation statistics of the failure sweep."""

from __future__ import annotations

import math

import pytest

from tests.support.checkout import probe

c = probe("correlation")  # bench/probes/correlation.py


def test_pearson_and_spearman_on_known_series():
    x = [1.0, 2.0, 3.0, 4.0, 5.0]
    assert c.pearson(x, [2 * v + 1 for v in x]) == pytest.approx(1.0)
    assert c.pearson(x, [-v for v in x]) == pytest.approx(-1.0)
    # monotone but not linear: Spearman 1, Pearson below 1
    y = [math.exp(v) for v in x]
    assert c.spearman(x, y) == pytest.approx(1.0) and c.pearson(x, y) < 0.95
    assert math.isnan(c.pearson([1.0, 1.0, 1.0], [1.0, 2.0, 3.0]))


def test_ranks_share_ties():
    assert c.ranks([3.0, 1.0, 3.0, 2.0]) == [3.5, 1.0, 3.5, 2.0]


def test_measures_weight_layers_by_size():
    numel = {"a": 3, "b": 1}
    versions = {"a": 8, "b": 4}
    assert c.weighted_staleness(numel, versions, 10) == pytest.approx((3 * 2 + 1 * 6) / 4)
    drift = {s: {"a": 1.0, "b": 0.5} for s in range(1, 11)}
    assert c.unsaved_drift(numel, versions, 10, drift) == pytest.approx((3 * 2 * 1.0 + 1 * 6 * 0.5) / 4)
    assert c.unsaved_drift(numel, versions, 10, drift, scale={"a": 2.0, "b": 0.5}) == pytest.approx(
        (3 * 2 * 1.0 / 2 + 1 * 6 * 0.5 / 0.5) / 4
    )


def test_correlations_cover_every_measure():
    points = [
        {
            "weighted_staleness": s,
            "unsaved_drift": 2 * s,
            "unsaved_drift_relative": -s,
            "lost_distance": s * s,
            "loss_dev_mean": s,
        }
        for s in (1.0, 2.0, 3.0, 4.0)
    ]
    out = c.correlations(points)
    assert set(out) == set(c.MEASURES)
    assert out["unsaved_drift"]["pearson"] == pytest.approx(1.0)
    assert out["unsaved_drift_relative"]["spearman"] == pytest.approx(-1.0)
    assert out["lost_distance"]["n"] == 4
