"""Releasing a survivor blocked in a collective (workers/collective_abort.py): what a rank decides
when told a peer is gone, that an abort releases a blocked training thread once and only where
it is needed, and what a capture after such a release may hold (workers/capture.py ``refusal``).
The blocked collective and the abort are scripted here (they stand for an NCCL kernel and
``ncclCommAbort``); tests/workers/test_capture_device.py runs the same on a real engine."""

from __future__ import annotations

import threading

import pytest

from layercheck.workers import collective_abort
from layercheck.workers.capture import StepMark, refusal
from layercheck.workers.collective_abort import AbortDecision, CollectiveAbort, decide, raises_by_itself


@pytest.mark.parametrize(
    "backend,training,raised,aborted,expected",
    [
        ("nccl", True, False, False, AbortDecision.ABORT),
        ("cpu:gloo,cuda:nccl", True, False, False, AbortDecision.ABORT),
        ("gloo", True, False, False, AbortDecision.NOT_NEEDED),
        ("nccl", True, True, False, AbortDecision.ALREADY_RAISED),
        ("nccl", False, False, False, AbortDecision.NOT_TRAINING),
        ("nccl", True, True, True, AbortDecision.ALREADY_ABORTED),
    ],
)
def test_decision(backend, training, raised, aborted, expected):
    assert decide(backend=backend, training=training, raised=raised, aborted=aborted) is expected


def test_only_nccl_waits_for_a_lost_peer():
    assert raises_by_itself("gloo") and not raises_by_itself("nccl") and not raises_by_itself("cpu:gloo,cuda:NCCL")


def test_an_abort_releases_a_blocked_training_thread_once():
    released = threading.Event()
    calls: list[str] = []

    def abort() -> None:
        calls.append("abort")
        released.set()

    watcher = CollectiveAbort(backend="nccl", abort=abort)
    watcher.arm()
    outcome: dict[str, object] = {}

    def training() -> None:  # blocked in a collective until the abort, then its step raises
        released.wait()
        outcome["released_by_abort"] = watcher.raised()

    thread = threading.Thread(target=training)
    thread.start()
    assert watcher.request("rank 1 died") is AbortDecision.ABORT
    thread.join(timeout=30)
    assert not thread.is_alive() and outcome["released_by_abort"] is True
    assert watcher.request("asked again") is AbortDecision.ALREADY_ABORTED
    assert calls == ["abort"] and watcher.reason == "rank 1 died"


def test_gloo_a_rank_that_raised_and_a_finished_rank_are_left_alone():
    calls: list[str] = []
    gloo = CollectiveAbort(backend="gloo", abort=lambda: calls.append("gloo"))
    gloo.arm()
    assert gloo.request("peer gone") is AbortDecision.NOT_NEEDED
    raised = CollectiveAbort(backend="nccl", abort=lambda: calls.append("raised"))
    raised.arm()
    assert raised.raised() is False  # raised by itself, not released by an abort
    assert raised.request("peer gone") is AbortDecision.ALREADY_RAISED
    finished = CollectiveAbort(backend="nccl", abort=lambda: calls.append("finished"))
    assert finished.request("peer gone") is AbortDecision.NOT_TRAINING  # never armed
    finished.arm()
    finished.disarm()
    assert finished.request("peer gone") is AbortDecision.NOT_TRAINING
    assert calls == []


def test_the_controller_reaches_the_installed_watcher_and_a_failed_abort_never_raises():
    def broken() -> None:
        raise RuntimeError("ncclCommAbort failed")

    try:
        assert collective_abort.request_abort("peer gone") == "no_watcher"
        watcher = collective_abort.install(CollectiveAbort(backend="nccl", abort=broken))
        watcher.arm()
        assert collective_abort.request_abort("peer gone") == "abort"  # logged, not raised
    finally:
        collective_abort.install(None)


def test_a_capture_past_the_last_completed_step_is_refused_only_where_collectives_fail_silently():
    last = StepMark(step=7, optimizer_step=7)
    assert refusal(last, 7, synchronous_errors=False) == ""
    assert refusal(last, 7, synchronous_errors=True) == ""
    assert refusal(last, 8, synchronous_errors=True) == ""  # gloo: the update used whole gradients
    assert "aborted collective" in refusal(last, 8, synchronous_errors=False)  # NCCL: it may not have


def test_a_request_after_the_train_function_ended_on_a_failure_says_it_had_raised():
    """The controller's request races the survivor's exit: once its step raised and its train
    function uninstalled the watcher, the rank still answers ``already_raised``."""
    try:
        watcher = collective_abort.install(CollectiveAbort(backend="gloo"))
        watcher.arm()
        watcher.raised()
        collective_abort.install(None)
        assert collective_abort.request_abort("peer gone") == "already_raised"
        clean = collective_abort.install(CollectiveAbort(backend="gloo"))
        clean.arm()
        clean.disarm()
        collective_abort.install(None)  # a normal end: no watcher, as in a process that never had one
        assert collective_abort.request_abort("peer gone") == "no_watcher"
    finally:
        collective_abort.install(None)


def test_a_rank_told_of_a_lost_peer_while_training_remembers_it_on_every_backend():
    """A wait outside the collectives (for a decision that needs the lost peer's report) fails on
    no backend by itself: ``peer_lost`` tells it (RayCoordinator raises PeerLost on it)."""
    try:
        assert collective_abort.peer_lost() == ""  # nothing installed
        for backend in ("gloo", "nccl"):
            watcher = collective_abort.install(CollectiveAbort(backend=backend, abort=lambda: None))
            assert collective_abort.peer_lost() == ""
            watcher.request("before training")  # not training yet: nothing to release
            assert collective_abort.peer_lost() == ""
            watcher.arm()
            watcher.request("rank 1 replaced")
            watcher.request("asked again")
            assert collective_abort.peer_lost() == "rank 1 replaced", backend
        raised = collective_abort.install(CollectiveAbort(backend="gloo"))
        raised.arm()
        raised.raised()  # its step raised already: it is on its way out, nothing waits
        raised.request("rank 1 replaced")
        assert collective_abort.peer_lost() == ""
    finally:
        collective_abort.install(None)
