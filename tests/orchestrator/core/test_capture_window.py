"""The capture window: the teardown of a broken group waits for survivors' captures, bounded."""

import threading

from layercheck.orchestrator.core.recovery.capture_window import (
    CaptureReport,
    CaptureWindow,
    capture_figures,
    recovery_step,
)


def _report(rank, *, held=True, attempt=1):
    return CaptureReport(rank=rank, attempt=attempt, step=6, layers=3, nbytes=100, held=held)


def test_the_hold_ends_when_every_survivor_that_began_has_ended():
    window = CaptureWindow(grace_s=30.0, timeout_s=60.0)
    window.began(0, attempt=1)
    window.began(2, attempt=1)
    threading.Timer(0.1, lambda: (window.ended(_report(0)), window.ended(_report(2, held=False)))).start()
    outcome = window.await_survivors(1, [0, 2], teardown_at=0.0)
    assert outcome.captured == (0,) and outcome.missed == (2,)  # rank 2's writer did not hold it all
    assert window.status()["holds"][0]["survivors"] == [0, 2]


def test_a_survivor_that_never_begins_is_given_up_after_the_grace_period():
    window = CaptureWindow(grace_s=0.1, timeout_s=60.0)  # rank 1 sits in a collective that never returns
    outcome = window.await_survivors(1, [1], teardown_at=0.0)
    assert outcome.captured == () and outcome.missed == (1,)


def test_a_capture_that_never_ends_is_given_up_at_the_timeout():
    window = CaptureWindow(grace_s=0.0, timeout_s=0.1)
    window.began(0, attempt=1)
    outcome = window.await_survivors(1, [0], teardown_at=0.0)
    assert outcome.missed == (0,)


def test_captures_of_an_older_attempt_do_not_count_for_a_newer_one():
    window = CaptureWindow(grace_s=0.1, timeout_s=60.0)
    window.ended(_report(0, attempt=1))
    assert window.await_survivors(2, [0], teardown_at=0.0).missed == (0,)


def test_the_figures_say_how_long_survivors_had_and_how_fast_they_captured():
    window = CaptureWindow(grace_s=0.0, timeout_s=5.0)
    window.ended(
        CaptureReport(rank=0, attempt=1, step=6, layers=3, nbytes=2_000_000, held=True, seconds=0.5, raised_at=100.0)
    )
    window.await_survivors(1, [0], teardown_at=100.25)
    (group,) = capture_figures(window.status())
    assert group["captured"] == [0] and group["steps"] == [6] and group["bytes"] == 2_000_000
    assert group["window_s"] == 0.25 and group["capture_gb_per_s"] == 0.004


def test_a_survivor_one_step_past_the_last_reported_step_moves_the_recovery_there():
    window = CaptureWindow()
    window.ended(_report(0))  # step 6
    window.ended(CaptureReport(rank=2, attempt=1, step=7, held=False))  # not held: does not count
    assert window.held_step(1) == 6 and window.held_step(2) is None
    assert recovery_step(5, window.held_step(1)) == 6  # rank 0 finished step 6; a dead rank's report of it was lost
    assert recovery_step(6, 6) == 6 and recovery_step(6, None) == 6
    assert recovery_step(4, 6) == 4  # never more than one step past what every rank reported


def test_a_failed_rank_is_waited_for_only_if_it_began_a_capture():
    window = CaptureWindow(grace_s=30.0, timeout_s=60.0)
    window.ended(_report(1))  # rank 1 captured, then raised: Ray Train counts it failed
    outcome = window.await_survivors(1, [], teardown_at=0.0, failed=[0, 1])  # rank 0 died: never began
    assert outcome.captured == (1,) and outcome.survivors == (1,) and outcome.missed == ()
