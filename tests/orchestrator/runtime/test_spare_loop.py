"""A warm spare of a user's own loop (``CheckpointConfig(in_place=True, spares=1)``;
orchestrator/runtime/in_place.py ``Seat``): it runs the loop as far as the loop goes without its
rank, waits there, and goes on as the rank it is promoted to, with Ray Train's context, the
environment and the process group agreeing; at the run's end without a promotion its loop unwinds
and it returns. In a spawned process of its own (tests/support/spare_jobs.py), with the roster
and the rendezvous the supervisor holds."""

from __future__ import annotations

import pytest

from tests.support.dist_harness import run_ranks
from tests.support.spare_jobs import both


@pytest.fixture(scope="module")
def spare_runs():
    """Both runs of the spare's loop, in one spawned process (the not-needed one first)."""
    (seen,) = run_ranks(both, 1)
    return seen


@pytest.mark.slow
def test_a_spare_builds_its_model_waits_for_a_rank_and_goes_on_as_the_lost_rank(spare_runs):
    seen = spare_runs["promoted"]
    assert seen["built_before_promotion"] and not seen["group_before_rank"], seen
    # Ray Train's world was 2 workers (1 training, this spare at world rank 1): the loop sees rank 0 of 1
    assert seen["ray"] == [0, 1] and seen["env"] == ["0", "1"] and seen["group"] == [0, 1], seen
    assert seen["spare"] and seen["counted_from_promotion"], seen
    start = seen["start"]
    assert start["spare"] and start["rank"] == 0 and start["start_s"] == 0.0 and not start["kept_process"], start
    assert seen["ended"] == "end" and seen["group_left"], seen  # its loop done: the roster's run is over


@pytest.mark.slow
def test_a_spare_the_run_never_needed_unwinds_its_loop_and_returns(spare_runs):
    seen = spare_runs["not_needed"]
    assert seen["returned"] is None and seen["finally"], seen
    assert seen["caught"] == [] and not seen["after"] and not seen["group"], seen
