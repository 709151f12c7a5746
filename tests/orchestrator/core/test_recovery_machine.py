"""The recovery machine (``layercheck.orchestrator.core.recovery.state_machine``), stepped one event at a
time (no Ray, no DeepSpeed): every transition of membership and recovery. Plans are made by the
real planner against a real store; fakes only script what went wrong. (The commit path it drives:
tests/orchestrator/core/test_commit_path.py.)"""

import logging

import pytest

from layercheck.orchestrator.core.accounting import RunAccount
from layercheck.orchestrator.core.persistence.commit_path import CommitPath, ShardWritten
from layercheck.orchestrator.core.recovery.config import SupervisionConfig
from layercheck.orchestrator.core.recovery.events import (
    AbandonIncomplete,
    CompositePlanned,
    DismissJoins,
    DrainWriters,
    NoComposite,
    PlanComposite,
    PublishResume,
    RankJoined,
    RebasePolicy,
    RecordRecovery,
    ReplaceWriters,
    ResumeInfo,
    RunEnded,
    VersionUnusable,
    WritersDrained,
)
from layercheck.orchestrator.core.recovery.plan_composite import plan_composite
from layercheck.orchestrator.core.recovery.state_machine import (
    Failed,
    Finished,
    Recovering,
    RecoveryMachine,
    Running,
    Starting,
)
from layercheck.orchestrator.core.run_view import RunView
from tests.support.store_helpers import receipt, relabel_version, write_layer

LAYERS = ("embed", "block.0", "norm")
NUMEL = {name: 42 for name in LAYERS}  # PARAMS: 6*5 + 5 + 7 elements per layer
CONFIG = SupervisionConfig(drain_deadline_s=5.0, commit_tries=3, commit_backoff_s=0.5)


def joined(rank, worker, *, world_size=2, last=0, now=0.0):
    return RankJoined(rank=rank, world_size=world_size, worker_id=worker, last_complete_step=last, now=now)


def running(sup=None):
    """A supervision whose attempt-1 group of two ranks (a0, a1) is training."""
    sup = sup or RecoveryMachine(config=CONFIG)
    sup.handle(joined(0, "a0"))
    sup.handle(joined(1, "a1"))
    return sup


def of(kind, actions):
    (action,) = [a for a in actions if isinstance(a, kind)]
    return action


def commit_all(store, step, *, base=False):
    for layer in LAYERS:
        write_layer(store, layer, step, base=base)


# ---- membership ------------------------------------------------------------------------------
def test_a_fresh_start_rebases_the_policy_and_answers_step_one():
    sup = RecoveryMachine(config=CONFIG)
    assert isinstance(sup.state, Starting) and sup.attempt == 0 and not sup.state.terminal
    actions = sup.handle(joined(0, "a0"))
    assert actions == [
        RebasePolicy(world_size=2, resume_after=0, persisted_steps={}),
        PublishResume(resume=ResumeInfo(1, 1)),
    ]
    assert sup.handle(joined(1, "a1")) == []  # the answer is published: the second rank just reads it
    assert sup.state == Running(attempt=1, world_size=2, members={0: "a0", 1: "a1"}, resume=ResumeInfo(1, 1))
    assert sup.state.name == "running" and sup.attempt == 1


def test_a_join_retried_by_the_same_worker_changes_nothing():
    sup = running()
    before = sup.state
    assert sup.handle(joined(0, "a0", last=9)) == []
    assert sup.state == before
    sup.handle(joined(0, "b0", last=4))  # a new group, recovering
    recovering = sup.state
    assert sup.handle(joined(0, "b0", last=4)) == [] and sup.state == recovering


def test_a_lost_group_recovers_at_t_fail_plus_one(store, caplog):
    commit_all(store, 3, base=True)
    commit_all(store, 6)
    sup = running()
    caplog.set_level(logging.INFO, logger="layercheck.orchestrator.core.recovery.state_machine")
    actions = sup.handle(joined(1, "b1", last=6, now=10.0))
    assert actions == [DrainWriters(attempt=2, deadline_s=5.0)]
    assert isinstance(sup.state, Recovering) and sup.state.t_fail == 6 and sup.state.phase == "draining"
    assert "lost after step 6" in caplog.text
    assert sup.handle(joined(0, "b0", last=6)) == []  # waits for the recovery
    actions = sup.handle(WritersDrained(attempt=2, now=10.25))
    assert isinstance(actions[0], AbandonIncomplete) and not actions[0].lost
    plan = of(PlanComposite, actions)
    assert plan.t_fail == 6 and sup.state.phase == "planning"
    planned = plan_composite(store, NUMEL, plan, clock=lambda: 10.5)
    assert isinstance(planned, CompositePlanned) and planned.max_staleness == 0
    actions = sup.handle(planned)
    resume = of(PublishResume, actions).resume
    assert resume.attempt == 2 and resume.start_step == 7
    assert {layer: r.step for layer, r in resume.records.items()} == {layer: 6 for layer in LAYERS}
    assert of(RebasePolicy, actions) == RebasePolicy(
        world_size=2, resume_after=6, persisted_steps={layer: 6 for layer in LAYERS}
    )
    record = of(RecordRecovery, actions)
    assert (record.t_fail, record.resumed_at, record.lost_group, record.groups_lost) == (6, 7, True, 1)
    assert record.plan_s == pytest.approx(0.5)  # from the detection, the writers' drain included
    assert record.drain_s == pytest.approx(0.25)  # timed apart: storage's share, not the plan's
    assert sup.state == Running(attempt=2, world_size=2, members={0: "b0", 1: "b1"}, resume=resume)


def test_a_failure_in_warm_up_restarts_from_the_initial_weights(store, caplog):
    sup = running()
    sup.handle(joined(0, "b0", last=2))
    plan = of(PlanComposite, sup.handle(WritersDrained(attempt=2)))
    planned = plan_composite(store, NUMEL, plan)  # nothing committed yet: no base
    assert isinstance(planned, NoComposite) and planned.t_fail == 2
    caplog.set_level(logging.WARNING, logger="layercheck.orchestrator.core.recovery.state_machine")
    actions = sup.handle(planned)
    assert "restarts from the initial weights" in caplog.text
    assert of(PublishResume, actions).resume == ResumeInfo(2, 1, None)
    assert of(RebasePolicy, actions) == RebasePolicy(world_size=2, resume_after=0, persisted_steps={})
    assert of(RecordRecovery, actions).resumed_at == 1


def test_a_failure_during_recovery_skips_the_version_that_broke_it(store):
    commit_all(store, 4, base=True)
    bad, _ = write_layer(store, "norm", 8)
    for layer in ("embed", "block.0"):
        write_layer(store, layer, 8)
    sup = running()
    sup.handle(joined(0, "b0", last=8))
    plan = of(PlanComposite, sup.handle(WritersDrained(attempt=2)))
    sup.handle(plan_composite(store, NUMEL, plan))
    # the new group reads a corrupt shard of norm@8, reports it and dies before training a step
    assert sup.handle(VersionUnusable(version_id=bad.version_id, reason="checksum")) == []
    actions = sup.handle(joined(0, "c0", last=8))
    assert actions == [DrainWriters(attempt=3, deadline_s=5.0)] and sup.state.t_fail == 8
    plan = of(PlanComposite, sup.handle(WritersDrained(attempt=3)))
    assert plan.skip == {bad.version_id: "checksum"}
    resume = of(PublishResume, sup.handle(plan_composite(store, NUMEL, plan))).resume
    assert resume.start_step == 9 and resume.records["norm"].step == 4 and resume.records["embed"].step == 8


def test_a_second_loss_before_recovery_ends_overtakes_it():
    sup = running()
    sup.handle(joined(0, "b0", last=6, now=1.0))
    actions = sup.handle(joined(0, "c0", last=6, now=3.0))  # b's group died while draining
    assert actions == [DismissJoins(attempt=2, reason="attempt 3 replaced it"), DrainWriters(attempt=3, deadline_s=5.0)]
    assert sup.state.attempt == 3 and sup.state.t_fail == 6 and sup.state.members == {0: "c0"}
    assert sup.handle(WritersDrained(attempt=2)) == []  # the overtaken drain's late answer
    plan = of(PlanComposite, sup.handle(WritersDrained(attempt=3)))
    stale = CompositePlanned(attempt=2, t_fail=6, records={}, max_staleness=0, weighted_staleness=0.0, now=4.0)
    assert sup.handle(stale) == [] and sup.state.phase == "planning"
    actions = sup.handle(NoComposite(attempt=plan.attempt, t_fail=6, reason="none", now=4.0))
    record = of(RecordRecovery, actions)
    assert record.groups_lost == 2 and record.detected_at == 3.0
    assert record.attempt == 3  # the attempt it resumed under, not the count of recoveries
    view = RunView(run_id="r", layer_numel=NUMEL, account=RunAccount(started=0.0))
    view.record_recovery(record)
    assert view.account.failures == 2 and len(view.account.recoveries) == 1
    assert view.account.recoveries[0].attempt == 3


def test_a_grown_group_is_new_whichever_rank_joins_first(caplog):
    """Ray Train grew an elastic group (1 -> 2 workers): its rank 1 was no member of the old group,
    yet it must not join the old attempt (it would be answered with that attempt's resume step while
    rank 0 resumes at t_fail + 1, and the ranks would train different steps: the run stalled)."""
    sup = RecoveryMachine(config=CONFIG)
    sup.handle(joined(0, "a0", world_size=1))  # training alone (the other node lost)
    caplog.set_level(logging.WARNING, logger="layercheck.orchestrator.core.recovery.state_machine")
    actions = sup.handle(joined(1, "b1", world_size=2, last=12, now=5.0))
    assert actions == [DrainWriters(attempt=2, deadline_s=5.0)]
    assert isinstance(sup.state, Recovering) and (sup.state.world_size, sup.state.t_fail) == (2, 12)
    assert "grew the group of attempt 1 (1 -> 2 workers) after step 12" in caplog.text
    assert sup.handle(joined(0, "b0", world_size=2, last=12)) == []  # its group-mate waits for the recovery
    assert sup.state.members == {0: "b0", 1: "b1"}
    plan = of(PlanComposite, sup.handle(WritersDrained(attempt=2)))
    actions = sup.handle(NoComposite(attempt=plan.attempt, t_fail=12, reason="none", now=6.0))
    assert of(RebasePolicy, actions).world_size == 2 and sup.state.world_size == 2
    record = of(RecordRecovery, actions)  # a restart, not a failure
    assert (record.world_size, record.grown_from, record.groups_lost) == (2, 1, 0)
    view = RunView(run_id="r", layer_numel=NUMEL, account=RunAccount(started=0.0))
    view.record_recovery(record)
    assert view.account.failures == 0 and view.account.recoveries[0].grown_from == 1


def test_a_resized_group_during_a_recovery_overtakes_it():
    sup = RecoveryMachine(config=CONFIG)
    sup.handle(joined(0, "a0", world_size=2))
    sup.handle(joined(0, "b0", world_size=1, last=8))  # shrunk after a loss: recovering alone
    actions = sup.handle(joined(1, "c1", world_size=2, last=8))  # grown back before that ended
    assert actions == [DismissJoins(attempt=2, reason="attempt 3 replaced it"), DrainWriters(attempt=3, deadline_s=5.0)]
    assert sup.state.world_size == 2 and sup.state.t_fail == 8 and sup.state.members == {1: "c1"}


def test_a_resumed_run_starts_at_the_stores_newest_recoverable_step(store):
    commit_all(store, 5, base=True)
    write_layer(store, "embed", 9)
    sup = RecoveryMachine(config=CONFIG, resume=True)
    actions = sup.handle(joined(0, "a0", world_size=1))
    assert actions == [PlanComposite(attempt=1, t_fail=None, skip={})]
    assert isinstance(sup.state, Recovering) and not sup.state.lost_group
    planned = plan_composite(store, NUMEL, actions[0])
    assert planned.t_fail == 9
    actions = sup.handle(planned)
    resume = of(PublishResume, actions).resume
    assert resume.start_step == 10 and resume.records["block.0"].step == 5
    record = of(RecordRecovery, actions)
    assert not record.lost_group and record.groups_lost == 0
    assert of(RebasePolicy, actions).world_size == 1


def test_a_resumed_run_continues_after_the_newest_step_of_versions_the_plan_accepts(store):
    """The version that would set the resume step (embed's, renamed consistently from step 6 to
    step 30: its files' headers still say 6) is rejected by the plan: the step too."""
    commit_all(store, 5, base=True)
    relabel_version(store, write_layer(store, "embed", 6)[0], 30)
    sup = RecoveryMachine(config=CONFIG, resume=True)
    planned = plan_composite(store, NUMEL, of(PlanComposite, sup.handle(joined(0, "a0", world_size=1))))
    assert planned.t_fail == 5 and planned.records["embed"].step == 5
    assert of(PublishResume, sup.handle(planned)).resume.start_step == 6


def test_a_resume_lost_in_its_load_is_resumed_again_from_the_versions_still_usable(store):
    """A --resume's group lost before it trained a step (a rank's load found a version of its
    composite corrupt): the retry plans as a --resume, at the newest step of the versions the plan
    still accepts, not at the step the rejected version set. Once it trained, a loss is a failure
    at the step reached."""
    commit_all(store, 5, base=True)
    bad, _ = write_layer(store, "norm", 9)
    sup = RecoveryMachine(config=CONFIG, resume=True)
    planned = plan_composite(store, NUMEL, of(PlanComposite, sup.handle(joined(0, "a0", world_size=1))))
    assert of(PublishResume, sup.handle(planned)).resume.start_step == 10 and sup.state.from_store
    assert not sup.plan_found_unusable
    sup.handle(VersionUnusable(version_id=bad.version_id, reason="checksum"))
    assert sup.plan_found_unusable  # a retry does other work: not a setup error
    actions = sup.handle(joined(0, "b0", world_size=1, last=9))  # the policy was rebased to 9; nothing trained
    assert actions == [DrainWriters(attempt=2, deadline_s=5.0)] and sup.state.t_fail is None
    plan = of(PlanComposite, sup.handle(WritersDrained(attempt=2)))
    assert plan == PlanComposite(attempt=2, t_fail=None, skip={bad.version_id: "checksum"})
    resume = of(PublishResume, sup.handle(plan_composite(store, NUMEL, plan))).resume
    assert resume.start_step == 6 and resume.records["norm"].step == 5
    assert sup.state.from_store and not sup.plan_found_unusable
    sup.handle(joined(0, "c0", world_size=1, last=7))  # this one trained steps 6 and 7, then was lost
    assert sup.state.t_fail == 7


def test_a_writer_that_never_answers_the_drain_is_written_off():
    sup = running()
    sup.handle(joined(0, "b0", last=6))
    actions = sup.handle(WritersDrained(attempt=2, unanswered=("writer-1@node",)))
    assert actions[0] == ReplaceWriters(writers=("writer-1@node",))
    assert (
        actions[1].lost
        and "did not answer the drain (dead with their node or process, or not done within 5s" in actions[1].reason
    )
    assert of(PlanComposite, actions).t_fail == 6  # recovery goes on from what is committed
    commits = CommitPath(layers=LAYERS, config=CONFIG)
    commits.handle(ShardWritten(receipt=receipt("embed", 6, 0)))  # rank 1's shard sat in the hung writer
    commits.handle(actions[1])
    assert commits.lost_versions == 1 and "did not answer the drain" in commits.lost[0]


@pytest.mark.parametrize("ok", [True, False])
def test_the_run_ends_finished_or_failed_and_ignores_later_events(ok):
    sup = running()
    sup.handle(joined(0, "b0", last=3))
    actions = sup.handle(RunEnded(ok=ok, reason="" if ok else "max_failures"))
    assert actions == [DismissJoins(attempt=2, reason="the run ended")]  # nobody waits for ever
    assert sup.state == (Finished() if ok else Failed("max_failures")) and sup.state.terminal
    assert sup.state.name == ("finished" if ok else "failed")
    assert sup.handle(joined(0, "c0", last=3)) == [] and sup.handle(WritersDrained(attempt=2)) == []


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="commit_tries"):
        SupervisionConfig(commit_tries=0)
    with pytest.raises(ValueError, match="drain_deadline_s"):
        SupervisionConfig(drain_deadline_s=0)
    assert [CONFIG.backoff_s(n) for n in (1, 2, 3)] == [0.5, 1.0, 2.0]
