"""``persistence.memory_period = "auto"`` (``orchestrator/core/memory/auto_period.py``): the period
chosen from the writers' host memory and rank 0's timings of its first memory versions, carried to
every rank on the policy's decisions (quiet steps included), and told again to a rebuilt policy."""

from __future__ import annotations

import pytest

from layercheck.orchestrator.core.memory.auto_period import (
    COST_SHARE,
    MAX_PERIOD,
    TIMED_COPIES,
    MemoryPeriod,
    PeriodTimer,
    choose_period,
    starting_period,
)
from layercheck.orchestrator.core.memory.budget import memory_version_need
from layercheck.orchestrator.core.policy_service import PolicyService
from layercheck.orchestrator.core.recovery.config import SupervisionConfig
from layercheck.orchestrator.core.run_supervisor import RunSupervisor
from layercheck.orchestrator.core.supervision_ports import LocalPolicy
from layercheck.policies.checkpoint_policy import build_policy
from layercheck.policies.configs import StaggeredConfig, drift_measured
from layercheck.workers.progress import StepProgress

NUMEL = {"embed": 4096, "block.0": 8192, "norm": 64}
NEED = memory_version_need(NUMEL, world_size=2, ranks=2)
GiB = 2**30


def test_a_set_period_is_kept_and_auto_starts_at_every_step_where_the_budget_holds_a_version():
    assert starting_period(0, need=NEED, memory_bytes=GiB) == MemoryPeriod(
        period=0, start=0, why="off (persistence.memory_period = 0)"
    )
    assert starting_period(3, need=NEED, memory_bytes=1).period == 3  # set: kept (the budget is warned of apart)
    start = starting_period("auto", need=NEED, memory_bytes=GiB)
    assert (start.period, start.auto, start.chosen_at) == (1, True, None)
    assert (
        start.why.startswith("auto: 1 until rank 0's first copies are timed (")
        and "of 1.00 GiB per writer" in start.why
    )


def test_auto_is_off_where_a_writer_cannot_hold_a_whole_memory_version_and_says_what_would():
    short = starting_period("auto", need=NEED, memory_bytes=NEED.nbytes - 1)
    assert (short.period, short.auto) == (0, True)
    assert short.why.startswith("auto: off (a memory version of the 2 rank(s) of 2 one writer holds is ")
    assert f"memory_bytes >= {NEED.nbytes} would hold it" in short.why
    assert starting_period("auto", need=NEED, memory_bytes=NEED.nbytes).period == 1  # exactly enough
    none = starting_period("auto", need=NEED, memory_bytes=0)
    assert (none.period, none.why) == (0, "auto: off (persistence.memory_bytes = 0: no memory tier)")


@pytest.mark.parametrize(
    ("copy_s", "step_s", "period"),
    [
        (0.0004, 0.220, 1),  # 0.2% of the step: every step
        (0.0022, 0.220, 1),  # exactly 1%: still every step (no float's last bit makes it 2)
        (0.0023, 0.220, 2),
        (0.010, 0.220, 5),  # 4.5%: one copy every 5 steps is 0.91% a step
        (0.0, 0.220, 1),
        (1.0, 1.0, MAX_PERIOD),  # 100% of a step: every 100 steps, the longest kept
    ],
)
def test_the_period_is_the_smallest_whose_copy_costs_at_most_one_percent_of_the_step_time(copy_s, step_s, period):
    chosen = choose_period(step_s=step_s, copy_s=copy_s, need=NEED, memory_bytes=GiB)
    assert chosen.period == period and chosen.auto
    assert copy_s / (chosen.period * step_s) <= COST_SHARE + 1e-12
    assert chosen.period == 1 or copy_s / ((chosen.period - 1) * step_s) > COST_SHARE


def test_the_choice_says_the_period_and_why():
    every = choose_period(step_s=0.220, copy_s=0.0004, need=NEED, memory_bytes=2 * GiB)
    assert (
        every.why
        == f"auto: 1 (copy 0.4 ms = 0.2% of a 220.0 ms step; {NEED.nbytes / 2**10:.2f} KiB of 2.00 GiB per writer)"
    )
    spread = choose_period(step_s=0.220, copy_s=0.010, need=NEED, memory_bytes=2 * GiB)
    assert spread.why.startswith("auto: 5 (copy 10.0 ms = 4.5% of a 220.0 ms step, 0.91% a step every 5; ")
    dear = choose_period(step_s=0.1, copy_s=0.2, need=NEED, memory_bytes=2 * GiB)
    assert dear.period == 0 and dear.why.startswith(
        f"auto: off (copy 200.0 ms = 200.0% of a 100.0 ms step: within 1% only every 200 steps, rarer than every {MAX_PERIOD}; "
    )
    with pytest.raises(ValueError, match="step_s must be > 0"):
        choose_period(step_s=0.0, copy_s=0.1, need=NEED, memory_bytes=GiB)


def test_the_timer_chooses_once_from_the_medians_of_the_copies_after_the_first():
    timer = PeriodTimer(starting_period("auto", need=NEED, memory_bytes=GiB), need=NEED, memory_bytes=GiB)
    assert timer.observe(step=1, compute_s=0.1, memory_s=0.0) is None  # no memory version at step 1
    assert timer.observe(step=2, compute_s=0.1, memory_s=5.0) is None  # the first copy allocates: not counted
    copies = [0.004, 0.0001, 0.003]  # median 3 ms of a 100 ms step: every 3 steps
    for step, copy_s in enumerate(copies[:-1], start=3):
        assert timer.observe(step=step, compute_s=0.1, memory_s=copy_s) is None
    chosen = timer.observe(step=3 + TIMED_COPIES - 1, compute_s=0.1, memory_s=copies[-1])
    assert chosen is not None and (chosen.period, chosen.chosen_at) == (3, 5) and timer.current == chosen
    assert timer.observe(step=6, compute_s=0.1, memory_s=0.1) is None  # chosen once
    assert (chosen.at(5), chosen.at(6)) == (1, 3)  # 1 in force up to the choice, then its period


def test_a_set_or_off_period_is_never_timed():
    for setting, budget in ((4, GiB), ("auto", 1)):
        timer = PeriodTimer(starting_period(setting, need=NEED, memory_bytes=budget), need=NEED, memory_bytes=budget)
        assert not any(timer.observe(step=s, compute_s=0.1, memory_s=0.05) for s in range(1, 20))
        assert timer.current.chosen_at is None and timer.current.at(19) == timer.current.period


def staggered_service(memory_period: int | None, drift_every: int = 4) -> PolicyService:
    config = StaggeredConfig(period=4, drift_every=drift_every)
    return PolicyService(
        build_policy(config, NUMEL), list(NUMEL), 1, drift_every=drift_every, memory_period=memory_period
    )


def complete(svc: PolicyService, step: int):
    if svc.quiet(step):
        return svc.complete_quiet(step, 1e-3)
    return svc.report(step=step, rank=0, lr=1e-3, abs_sums=dict.fromkeys(NUMEL, 0.1), counts=NUMEL)


def test_decisions_carry_the_period_and_a_new_one_from_the_next_measured_step_plans_included():
    svc = staggered_service(memory_period=1)
    assert complete(svc, 1).memory_period == 1  # (measured: step 1, then every 4th, 5, 9, ...)
    svc.set_memory_period(3)  # chosen after step 1: the quiet steps' plan already went out with 1
    assert [d.memory_period for d in svc.plan()] == [1, 1, 1]
    assert [complete(svc, s).memory_period for s in (2, 3, 4)] == [1, 1, 1]
    assert drift_measured(5, 4) and complete(svc, 5).memory_period == 3
    assert [d.memory_period for d in svc.plan()] == [3, 3, 3]
    svc.restart(world_size=1, resume_after=5, persisted_steps={})
    assert complete(svc, 6).memory_period == 3  # a new group's decisions carry it too
    assert complete(staggered_service(memory_period=None), 1).memory_period is None  # set periods: not carried


class Writers:
    def drain(self, deadline_s):
        return ()

    def replace(self, names):
        pass


class RebuiltPolicy(LocalPolicy):
    """A policy actor Ray rebuilt after its process died: a fresh service with its first arguments."""

    def rebuild(self) -> None:
        self.service = staggered_service(memory_period=1, drift_every=1)


def test_the_supervisor_chooses_from_rank_0s_progress_and_tells_the_policy_again_after_a_rebuild(store):
    policy = RebuiltPolicy(staggered_service(memory_period=1, drift_every=1))
    timer = PeriodTimer(starting_period("auto", need=NEED, memory_bytes=GiB), need=NEED, memory_bytes=GiB)
    run = RunSupervisor(
        run_id="r",
        store=store,
        layer_numel=NUMEL,
        policy=policy,
        writers=Writers(),
        config=SupervisionConfig(drain_deadline_s=5.0),
        memory_period=timer,
    )
    run.join(0, 1, "a0")
    assert run.status().memory_period["period"] == 1
    for step in range(1, 6):  # copies of 2 ms in steps of 100 ms (the first not counted): every 2 steps
        complete(policy.service, step)
        run.progress(StepProgress(step=step, loss=1.0, lr=1e-3, compute_s=0.1, stall_s=0.002, memory_s=0.002))
    told = run.status().memory_period
    assert (told["period"], told["chosen_at"], told["auto"]) == (2, 4, True)
    assert told["why"].startswith("auto: 2 (copy 2.0 ms = 2.0% of a 100.0 ms step")
    assert complete(policy.service, 6).memory_period == 2  # the next decision carries it to every rank
    policy.rebuild()
    assert policy.service.memory_period == 1  # started over at the first period, as Ray rebuilds it
    run.join(0, 1, "b0")  # the new group: the policy restarted, and told the run's period again
    assert policy.service.memory_period == 2
