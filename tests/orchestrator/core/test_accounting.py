"""The run account (``layercheck.orchestrator.core.accounting``): productive time, lost steps,
stalls and ETTR across failures."""

import pytest

from layercheck.orchestrator.core.accounting import RankStart, RunAccount
from layercheck.workers.progress import StepProgress


def test_account_drops_lost_steps_from_productive_time():
    account = RunAccount(started=0.0)
    for step in range(1, 6):
        account.step_done(step, compute_s=1.0, stall_s=0.25 if step == 2 else 0.0, now=float(step), loss=5.0 - step)
    recovery = account.failed(t_fail=4, resumed_at=5, now=12.0)
    assert recovery.detect_restart_s == 7.0 and recovery.steps_redone == 0
    assert account.productive_s == 4.0 and account.lost_step_seconds == 1.0
    assert sorted(account.history) == [1, 2, 3, 4]
    assert account.ettr(now=20.0) == pytest.approx(0.2)
    assert account.stall_seconds == 0.25 and account.stalls == 1
    again = account.failed(t_fail=4, resumed_at=1, now=13.0)  # no composite: start over
    assert again.steps_redone == 4 and account.productive_s == 0.0


def test_a_recovery_is_timed_from_the_failure_to_the_next_completed_step():
    """The summary's recovery time ends when the new group completed a step, not when its first
    rank joined: its engine build, its load and its first step are in it, phase by phase."""
    account = RunAccount(started=0.0)
    for step in range(1, 5):
        account.step_done(step, compute_s=0.5, stall_s=0.0, now=float(step))
    recovery = account.failed(t_fail=4, resumed_at=5, now=10.0)  # the new group's first rank joined
    recovery.plan_s, recovery.load_s = 0.25, 0.5
    recovery.rank_ready(RankStart(start_s=3.0, build_s=6.0), now=16.75)  # each rank: process start, engine build
    recovery.rank_ready(RankStart(start_s=2.5, build_s=6.5), now=17.0)
    assert recovery.failure_to_step_s is None and recovery.total_s == 6.0 + 0.25 + 0.5  # what is known so far
    assert recovery.timeline()["restart"] == 3.0  # until the step: 6 s to the first join, less the start
    account.step_done(5, compute_s=0.5, stall_s=0.0, now=17.5)
    assert recovery.failure_to_step_s == 13.5 and recovery.total_s == 13.5
    assert recovery.timeline() == {
        "restart": 3.0,  # the failure noticed, the group torn down, new processes up: the rest of the 13.5 s
        "start": 3.0,
        "group": 0.0,  # Ray Train formed it, inside the start
        "build": 6.5,
        "plan": 0.25,  # during the build: not in the sum
        "load": 0.5,
        "first_step": 0.5,
    }
    assert recovery.path == "full restart"
    account.step_done(6, compute_s=0.5, stall_s=0.0, now=18.0)
    assert recovery.failure_to_step_s == 13.5  # the first step after it, once


def test_an_in_place_recovery_is_timed_by_its_replacement_and_says_its_path():
    """The survivor joins at once and kept its process (no start); the replacement's start, the
    process group they form and the builds are what the recovery waits for. The phases add up to
    the total, the plan aside."""
    account = RunAccount(started=0.0)
    account.step_done(1, compute_s=0.5, stall_s=0.0, now=1.0)
    recovery = account.failed(t_fail=1, resumed_at=2, now=1.25)  # the survivor's join, a moment after
    recovery.plan_s, recovery.load_s = 0.5, 0.25
    recovery.rank_ready(RankStart(group_s=0.25, build_s=2.0, kept_process=True), now=9.0)
    recovery.rank_ready(RankStart(start_s=5.0, group_s=0.125, build_s=2.5), now=9.5)
    account.step_done(2, compute_s=0.5, stall_s=0.0, now=10.0)
    timeline = recovery.timeline()
    assert recovery.failure_to_step_s == 9.0 and recovery.path == "in place" and recovery.kept_processes == 1
    assert timeline == {
        "restart": 0.5,  # 9 s less the replacement's start, the group, its build, the load and the step
        "start": 5.0,
        "group": 0.25,
        "build": 2.5,
        "plan": 0.5,
        "load": 0.25,
        "first_step": 0.5,
    }
    assert sum(v for k, v in timeline.items() if k != "plan") == recovery.failure_to_step_s


def _view(in_place: bool = True):
    from layercheck.orchestrator.core.run_view import RunView

    return RunView(run_id="r", layer_numel={"a": 1}, account=RunAccount(started=0.0), in_place=in_place)


def _recover(view, t_fail: int, now: float):
    from layercheck.orchestrator.core.recovery.events import RecordRecovery

    view.record_recovery(
        RecordRecovery(t_fail=t_fail, resumed_at=t_fail + 1, lost_group=True, detected_at=now, plan_s=0.0)
    )
    return view.account.recoveries[-1]


def _step(view, step: int, now: float) -> None:
    view.step_done(StepProgress(step=step, loss=1.0, lr=0.1, compute_s=0.1, stall_s=0.0), now=now)


def test_each_rank_of_a_recovery_keeps_its_own_phases_beside_the_slowest():
    """The timeline takes each phase from the slowest rank; each rank's own (the survivor's rerun
    of its loop, the promoted spare's since its promotion) is kept too, with its load."""
    view = _view()
    recovery = _recover(view, 3, now=1.0)
    view.loaded(0.25, start=RankStart(rank=0, group_s=0.5, build_s=2.0, leave_s=0.75, kept_process=True), now=4.0)
    view.loaded(0.125, start=RankStart(rank=1, group_s=0.25, build_s=1.0, spare=True), now=4.5)
    assert recovery.ranks == [
        {
            "rank": 0,
            "start_s": 0.0,
            "group_s": 0.5,
            "build_s": 2.0,
            "leave_s": 0.75,
            "waited_s": 0.0,
            "kept_process": True,
            "spare": False,
            "load_s": 0.25,
        },
        {
            "rank": 1,
            "start_s": 0.0,
            "group_s": 0.25,
            "build_s": 1.0,
            "leave_s": 0.0,
            "waited_s": 0.0,
            "kept_process": False,
            "spare": True,
            "load_s": 0.125,
        },
    ]
    assert (recovery.build_s, recovery.load_s, recovery.kept_processes, recovery.spares_promoted) == (2.0, 0.25, 1, 1)


def test_a_full_restart_of_an_in_place_run_says_why_and_only_for_its_own_recovery():
    """A run that asked for in place and recovered by a full restart says why: the reason a rank
    gave as it raised out of its train function (before the new group, or during a recovery under
    way), or, when no rank said anything, that none survived. A reason is told once: the next
    failure's recovery does not inherit it. A run that did not ask says nothing."""
    from layercheck.orchestrator.core.accounting import FallbackReason

    view = _view()
    _step(view, 1, now=1.0)
    view.in_place_refused(FallbackReason("rank_failed", "rank 0: ValueError: bad batch"))
    first = _recover(view, t_fail=1, now=2.0)
    assert first.path == "full restart" and first.fallback == "rank_failed"
    assert first.refused is not None and first.refused.detail == "rank 0: ValueError: bad batch"
    _step(view, 2, now=3.0)

    second = _recover(view, t_fail=2, now=4.0)  # nobody said anything: every rank was lost
    assert second.fallback == "no_survivor" and second.refused is None
    # a survivor's recovery in its own process fails: it says so, to this recovery and the next
    view.in_place_refused(FallbackReason("recovery_failed", "rank 0: TimeoutError: regroup"))
    assert second.fallback == "recovery_failed"
    third = _recover(view, t_fail=2, now=5.0)
    assert third.fallback == "recovery_failed"
    _step(view, 3, now=6.0)
    fourth = _recover(view, t_fail=3, now=7.0)
    assert fourth.fallback == "no_survivor", "a reason told once is not told again"
    fourth.rank_ready(RankStart(kept_process=True), now=8.0)
    assert fourth.path == "in place" and fourth.fallback == ""

    not_asked = _view(in_place=False)
    _step(not_asked, 1, now=1.0)
    assert _recover(not_asked, t_fail=1, now=2.0).fallback == ""


def test_a_failed_recovery_in_place_turns_in_place_off_for_the_rest_of_the_run():
    """A survivor's own step failing says nothing of in-place recovery; its recovery in its own
    process failing does: the first such failure is what keeps it off from then on."""
    from layercheck.orchestrator.core.accounting import FallbackReason

    view = _view()
    view.in_place_refused(FallbackReason("rank_failed", "rank 0: ValueError: bad batch"))
    assert view.in_place_off is None
    view.in_place_refused(FallbackReason("recovery_failed", "rank 1: OSError: x"))
    view.in_place_refused(FallbackReason("recovery_failed", "rank 0: OSError: y"))
    assert view.in_place_off == FallbackReason("recovery_failed", "rank 1: OSError: x")
    with pytest.raises(ValueError, match="unknown fallback reason"):
        FallbackReason("tired", "")
