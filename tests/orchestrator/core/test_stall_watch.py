"""The driver says when a run stops making steps (issue 59: a hung rank is never a silent stall)."""

from pathlib import Path

from layercheck.orchestrator.core.stall_watch import StallWatch, never_reported, stall_message


def test_a_stall_is_told_once_past_its_bound_and_a_step_ends_it():
    watch = StallWatch(after_s=60)
    assert watch.stalled_for(5, training=True, now=0.0) is None
    assert watch.stalled_for(5, training=True, now=59.0) is None
    assert watch.stalled_for(5, training=True, now=61.0) == 61.0
    assert watch.stalled_for(5, training=True, now=200.0) is None  # told once per stall
    assert watch.stalled_for(6, training=True, now=201.0) is None  # a step: a new count
    assert watch.stalled_for(6, training=True, now=262.0) == 61.0


def test_no_stall_is_counted_while_the_group_is_not_training():
    watch = StallWatch(after_s=60)
    watch.stalled_for(5, training=True, now=0.0)
    assert watch.stalled_for(5, training=False, now=100.0) is None  # recovering: bounds of its own
    assert watch.stalled_for(5, training=True, now=130.0) is None  # counted from its return
    assert watch.stalled_for(5, training=True, now=161.0) == 61.0


def test_the_message_names_the_ranks_that_never_reported_the_next_step():
    hung = stall_message(41, 612.4, {3: 41}, world_size=8)
    assert hung.startswith("no step completed for 612s (the last: step 41); ")
    assert "rank 3 (last reported step 41) never reported step 42: hung, not dead" in hung
    assert hung in (Path(__file__).parents[3] / "docs" / "cluster.md").read_text()  # the page quotes it as it is
    everyone = stall_message(41, 612.0, {r: 41 for r in range(8)}, world_size=8)
    assert "no rank reported step 42: the ranks wait inside a collective" in everyone
    assert "every rank reported step 42" in stall_message(41, 612.0, {}, world_size=8)
    assert "did not say" in stall_message(41, 612.0, None, world_size=8)


def test_a_rank_that_reported_nothing_since_its_group_started_is_said_so():
    assert never_reported({4: 0, 1: 7}) == "rank 1 (last reported step 7), rank 4 (none reported)"
