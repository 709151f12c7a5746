"""The local runtime measures the writers' drain bandwidth and every replica plans under the same budget."""

from __future__ import annotations

import pytest

from tests.support.budget_jobs import CAP


@pytest.fixture(scope="module")
def ranks(local_runtime):
    """The write-budget job's results (spawned with the local loop's scenarios: tests/conftest.py)."""
    return local_runtime["budget"]


@pytest.mark.slow
def test_every_replica_sees_the_same_measured_budget(ranks):
    a, b = ranks[0]["measured"], ranks[1]["measured"]
    assert a["budgets"] == b["budgets"]
    assert a["budgets"][0] is None  # nothing written yet
    assert any(x is not None and x > 0 for x in a["budgets"])
    assert all(x is None for x in ranks[0]["free"]["budgets"])  # opt-in


@pytest.mark.slow
def test_a_capped_budget_stretches_the_schedule(ranks):
    capped, free = ranks[0]["capped"], ranks[0]["free"]
    assert capped["budgets"] == ranks[1]["capped"]["budgets"]
    assert max(x for x in capped["budgets"] if x is not None) <= CAP
    assert capped["binding"] and capped["plan_budget"] <= CAP
    assert capped["handed_params"] < free["handed_params"]
