"""The local runtime measures the writers' drain bandwidth and every replica plans under the same budget."""

from __future__ import annotations

import pytest

from tests.support import budget_jobs
from tests.support.dist_harness import run_ranks

CAP = 20_000  # bytes per step: a fraction of the tiny model's state (~0.9 MB) per period of 2


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_ranks(budget_jobs.budget_job, 2, str(tmp_path_factory.mktemp("budget")), CAP)


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
