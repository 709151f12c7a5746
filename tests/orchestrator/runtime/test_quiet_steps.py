"""Quiet steps (``PolicyService.quiet``): with ``drift_every`` > 1 the steps between measurements
carry no drift and the news that changes the schedule (settlements, the write budget) waits for the
next measured step, so their decisions are known, and handed out as a plan, as soon as the
measured step before them completes. The ranks then exchange nothing on them: the Ray ranks
collect no answer (``RayCoordinator``), the local replicas complete them alone
(``LocalCoordinator``, on real ranks in tests/orchestrator/local/test_local_loop.py)."""

from __future__ import annotations

import asyncio
import copy
import random
from concurrent.futures import Future
from typing import Any
from unittest import mock

import pytest
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from layercheck.orchestrator.core.policy_service import PolicyService
from layercheck.orchestrator.local.local_coordinator import LocalCoordinator
from layercheck.orchestrator.runtime import policy_actor
from layercheck.orchestrator.runtime.ray_coordinator import RayCoordinator
from layercheck.orchestrator.store.layer_store import LayerStore
from layercheck.policies.checkpoint_policy import KnowsQuietSteps, build_policy
from layercheck.policies.configs import StaggeredConfig, drift_measured
from layercheck.policies.decision import PersistDecision
from layercheck.policies.staggered import StaggeredPolicy
from layercheck.policies.trace import observation_json
from layercheck.workers.drift.probe import LayerDrift
from tests.support.dist_harness import run_ranks

NUMEL = {"embed": 4000, "block.0": 1000, "block.1": 1000, "block.2": 1000, "lm_head": 3000}
RATE = 1e-3  # mean |update| a step, every layer
EVERY = 5


def service(world_size: int = 2, **config) -> PolicyService:
    policy = StaggeredConfig(**{"period": 4, "drift_every": EVERY, **config})
    return PolicyService(
        build_policy(policy, NUMEL), list(NUMEL), world_size, max_versions_in_flight=1, drift_every=policy.drift_every
    )


def report(svc: PolicyService, step: int, rank: int) -> PersistDecision | None:
    measured = drift_measured(step, svc.drift_every)
    return svc.report(
        step=step,
        rank=rank,
        lr=1e-3,
        abs_sums={n: RATE * size / 2 for n, size in NUMEL.items()} if measured else {},
        counts={n: size // 2 for n, size in NUMEL.items()},
        measured=measured,
    )


def complete(svc: PolicyService, step: int) -> PersistDecision:
    for rank in range(svc.world_size - 1):
        assert report(svc, step, rank) is None  # a step completes with the last rank's report only
    decision = report(svc, step, svc.world_size - 1)
    assert decision is not None
    return decision


def test_the_quiet_steps_are_those_between_measurements():
    svc = service()
    assert [s for s in range(1, 17) if not svc.quiet(s)] == [1, 6, 11, 16]
    assert not any(service(drift_every=1).quiet(s) for s in range(1, 17))


def test_a_plan_is_what_the_quiet_steps_then_decide_whatever_news_arrives_meanwhile():
    svc = service()
    planned: dict[int, PersistDecision] = {}
    decided: dict[int, PersistDecision] = {}
    for step in range(1, 61):
        decided[step] = complete(svc, step)
        if not svc.quiet(step):
            plan = svc.plan()
            assert [d.step for d in plan] == list(range(step + 1, step + EVERY))
            planned.update((d.step, d) for d in plan)
        else:  # news mid-window: every version so far settles, storage slows down
            for layer in NUMEL:
                svc.settled(layer, step)
            svc.set_write_budget(25_000 - 100 * step)
    quiet = [s for s in decided if svc.quiet(s)]
    assert quiet and all(decided[s] == planned[s] for s in quiet)
    assert sum(bool(decided[s]) for s in quiet) > 10  # the plans did persist layers
    # the news reached the schedule at the measured steps only, the quiet steps saw the one before
    budgets = {o.step: o.write_budget_bytes for o in svc.trace}
    assert budgets[5] is None and budgets[6] == 25_000 - 100 * 5 and budgets[10] == budgets[6]
    assert budgets[11] == 25_000 - 100 * 10
    assert all(not o.measured and not o.drift for o in svc.trace if svc.quiet(o.step))


def test_a_settlement_frees_a_layer_at_the_next_measured_step():
    svc = service(period=1, max_bytes_per_step=None)  # every layer every step: the gate holds them back
    complete(svc, 1)
    assert {d.step: d.names for d in svc.plan()} == {s: () for s in range(2, 6)}  # all in flight since 1
    svc.settled("embed", 1)
    assert not complete(svc, 2)  # the plan holds
    for step in range(3, 6):
        complete(svc, step)
    assert complete(svc, 6).names == ("embed",)


def test_a_quiet_step_still_completes_only_once_every_rank_reported_it():
    svc = service()
    complete(svc, 1)
    report(svc, 2, 0)
    assert svc.last_complete_step == 1  # t_fail: rank 1 never finished step 2
    report(svc, 2, 1)
    assert svc.last_complete_step == 2


def test_a_replica_completing_the_quiet_steps_alone_decides_as_every_rank_reporting_them():
    reported, alone = service(), service()
    for step in range(1, 41):
        expected = complete(reported, step)
        if alone.quiet(step):
            assert alone.complete_quiet(step, 1e-3) == expected
            assert alone.complete_quiet(step, 1e-3) == expected  # a repeat is answered, not counted again
        else:
            assert complete(alone, step) == expected
        if step % 7 == 0:  # news mid-window
            for svc in (reported, alone):
                svc.settled("embed", step)
    assert alone.trace == reported.trace and alone.last_complete_step == 40
    with pytest.raises(ValueError, match="not quiet"):
        alone.complete_quiet(41, 1e-3)  # measured: every rank's drift is needed


def test_a_restart_in_a_quiet_window_plans_the_rest_of_it_from_the_rebased_schedule():
    svc = service()
    for step in range(1, 9):
        complete(svc, step)
    svc.restart(world_size=2, resume_after=7, persisted_steps={n: 4 for n in NUMEL})
    plan = svc.plan()
    assert [d.step for d in plan] == [8, 9, 10]
    assert [complete(svc, s) for s in (8, 9, 10)] == plan
    assert not svc.plan() and not svc.quiet(11)


class _Answer(Future):
    """A policy actor's answer, in: the future the sending thread hands back. Without a value, one
    the rank must not collect."""

    def __init__(self, value=None) -> None:
        super().__init__()
        self.set_result(value)

    def result(self, timeout=None):
        value = super().result(timeout)
        assert value is not None, "collected the answer of a planned quiet step"
        return value


def sent(answer: _Answer) -> Future:
    """The report as the sending thread hands it back, once it has left: its answer's future."""
    future: Future = Future()
    future.set_result(answer)
    return future


def test_the_policy_actor_hands_the_plan_with_the_measured_steps_answer_and_a_rank_collects_no_other():
    config = StaggeredConfig(period=4, drift_every=EVERY)
    actor = policy_actor.PolicyActor.__ray_actor_class__(config, NUMEL, 1, 1)

    def answer(step: int):
        measured = drift_measured(step, EVERY)
        sums = {n: RATE * size for n, size in NUMEL.items()} if measured else {}
        return asyncio.run(actor.report(step, 0, 1e-3, sums, NUMEL if measured else {}, measured))

    first = answer(1)
    assert [d["step"] for d in first["plan"]] == [2, 3, 4, 5]
    rank = RayCoordinator(rank=0, policy=None, writer=None, supervisor=None, max_inflight_bytes=1)
    assert rank.decision((1, sent(_Answer(first)))) == PersistDecision.from_json(first)
    for step in range(2, 6):  # no answer collected: the plan's decision is the actor's own
        assert rank.decision((step, sent(_Answer()))) == PersistDecision.from_json(answer(step))
    assert not answer(5)["plan"] and answer(6)["plan"]


class _SimulatesItsQuietSteps(StaggeredPolicy):
    """The same policy without ``decides_nothing_before``: the service plans its quiet steps on a copy."""

    decides_nothing_before = None  # type: ignore[assignment]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**16), drift_every=st.integers(2, 12))
def test_the_quiet_steps_a_policy_knows_decide_nothing_decide_nothing_when_simulated(seed, drift_every):
    """``PolicyService.decides_nothing`` (the policy's ``decides_nothing_before``) against the same
    policy without it: every quiet step it names ahead of time then decides nothing, the plans are
    the same (a window known to decide nothing is planned without a copy), and every step decides
    the same, whatever the write budget (0 included), the settlements, the deferrals and the restarts."""
    rng = random.Random(seed)
    numel = {f"l{i}": rng.randrange(1, 5000) for i in range(rng.randrange(1, 8))}
    config = StaggeredConfig(
        period=rng.randrange(2, 30), smax=rng.randrange(3, 80), drift_every=drift_every, warmup_steps=rng.randrange(8)
    )
    known, simulated = (
        PolicyService(policy, list(numel), 1, max_versions_in_flight=1, drift_every=drift_every)
        for policy in (StaggeredPolicy(config, numel), _SimulatesItsQuietSteps(config, numel))
    )
    assert known._knows_quiet and not simulated._knows_quiet
    assert isinstance(known.policy, KnowsQuietSteps) and not isinstance(simulated.policy, KnowsQuietSteps)
    claimed: set[int] = set()
    for step in range(1, 300):
        news = rng.random()
        budget = rng.choice([None, 0, rng.randrange(1, 12 * sum(numel.values()))]) if news < 0.05 else None
        settle = [(n, steps[0]) for n, steps in known.gate.in_flight.items() if rng.random() < 0.3]
        for svc in (known, simulated):
            if news < 0.05:
                svc.set_write_budget(budget)
            for layer, version_step in settle:
                svc.settled(layer, version_step)
        if known.quiet(step):
            decided = [svc.complete_quiet(step, 1e-3) for svc in (known, simulated)]
        else:
            drift = {n: rng.uniform(0.0, 2.0) * size for n, size in numel.items()}
            decided = [
                svc.report(step=step, rank=0, lr=1e-3, abs_sums=drift, counts=numel) for svc in (known, simulated)
            ]
        assert decided[0] == decided[1], step
        assert not (step in claimed and decided[0]), step
        assert not simulated.decides_nothing(step + 1)
        nothing = {s for s in range(step + 1, step + drift_every) if known.decides_nothing(s)}
        claimed |= nothing
        with mock.patch("copy.deepcopy", side_effect=copy.deepcopy) as deepcopy:
            plan = known.plan()
        assert plan == simulated.plan(), step
        assert not (deepcopy.called and {d.step for d in plan} <= nothing)  # known to decide nothing: no copy
        if rng.random() < 0.02:  # a recovery loaded some layers' last versions
            kept = {n: s for n, s in known.policy.last_persisted.items() if s is not None and rng.random() < 0.7}
            for svc in (known, simulated):
                svc.restart(world_size=1, resume_after=step, persisted_steps=kept)
            claimed.clear()  # (a new group: the claims were for the lost one's steps)
    assert known.policy.state_dict() == simulated.policy.state_dict()


def test_with_the_default_schedule_most_quiet_steps_are_known_to_decide_nothing():
    numel = {"embed": 40_000, **{f"block.{i}": 20_000 for i in range(6)}, "lm_head": 40_000}
    svc = PolicyService(build_policy(StaggeredConfig(), numel), list(numel), 1, drift_every=StaggeredConfig.drift_every)
    known = decided = 0
    for step in range(1, 401):
        if svc.quiet(step):
            known += svc.decides_nothing(step)
            decided += bool(svc.complete_quiet(step, 1e-3))
        else:
            svc.report(step=step, rank=0, lr=1e-3, abs_sums={n: 1e-3 * size for n, size in numel.items()}, counts=numel)
    quiet = sum(map(svc.quiet, range(1, 401)))
    assert decided and known > 0.75 * quiet
    assert known <= quiet - decided


def _replica_job(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """One rank's ``LocalCoordinator`` fed as the loop feeds it; what it decided, and when (JSON)."""
    dist.init_process_group("gloo")  # (spawn_ranks set the rendezvous; it destroys the group after)
    coordinator = LocalCoordinator(
        policy=build_policy(StaggeredConfig(period=12, drift_every=EVERY), NUMEL),
        layer_numel=NUMEL,
        store=LayerStore.open(root, fsync=False),
        max_inflight_bytes=2**20,
        max_versions_in_flight=1,  # as the reference's (nothing is persisted here, so nothing settles)
        drift_every=EVERY,
    )
    handle, decided, deferred = None, {}, 0
    for step in range(1, 12 * EVERY + 2):
        measured = drift_measured(step, EVERY)
        drift = LayerDrift(
            step=step,
            l1={n: RATE * size for n, size in NUMEL.items()} if measured else {},
            numel=dict(NUMEL),
            measured=measured,
        )
        new = coordinator.report(drift, 1e-3)
        if handle is not None:  # the loop collects step t's decision after step t + 1
            decided[handle] = coordinator.decision(handle)
            deferred += coordinator.service.last_complete_step < handle
        handle = new
    last = coordinator.last_complete_step()
    return {
        "decided": [decided[step].to_json() for step in sorted(decided)],
        "deferred": deferred,
        "last": last,
        "trace": [observation_json(o) for o in coordinator.service.trace],
        "closed": coordinator.close(60),
    }


def test_a_replica_answers_the_quiet_steps_known_to_decide_nothing_at_once_and_completes_them_later(tmp_path):
    """``LocalCoordinator.decision`` of a quiet step known to decide nothing answers without feeding
    the replica; the next step that may decide completes them all, in order. Every decision, and
    the replica's trace, are those of a service completing every step as it comes (one rank, in a
    process of its own: the coordinator needs the default process group)."""
    (out,) = run_ranks(_replica_job, 1, str(tmp_path))
    assert out["last"] == 12 * EVERY + 1 and out["closed"]  # every reported step, completed
    reference = service(world_size=1, period=12)
    decided = {d.step: d for d in map(PersistDecision.from_json, out["decided"])}
    assert sorted(decided) == list(range(1, 12 * EVERY + 1))
    for step in decided:
        assert decided[step] == complete(reference, step), step
    quiet = [s for s in decided if reference.quiet(s)]
    assert any(decided[s] for s in quiet) and out["deferred"] > len(quiet) / 2
    assert out["trace"][:-1] == [observation_json(o) for o in reference.trace]  # (the reference stops a step short)
