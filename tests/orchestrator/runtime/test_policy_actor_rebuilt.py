"""A policy actor whose process died is rebuilt by Ray (``max_restarts``) with its state gone. It
decides nothing until the supervisor restarts it for the next group, so every step's decision
comes from one process: the old one for the steps up to its death, the rebuilt one for the next
group's. A rank finds out at the next answer it collects (a call that died, or the rebuilt actor's
refusal) and raises ``PolicyActorLost``: the group is recovered. A rank holding a plan from the old
actor carries its quiet steps out as every other rank does, without asking. The actor's class is
driven here without Ray (its reports as coroutines), the rank's coordinator with scripted answers;
the whole of it on a real Ray: ``tests/e2e/test_control_plane_loss.py``."""

from __future__ import annotations

import asyncio
from concurrent.futures import Future

import pytest
import ray

from layercheck.orchestrator.runtime import policy_actor
from layercheck.orchestrator.runtime.policy_actor import PolicyActorLost
from layercheck.orchestrator.runtime.ray_coordinator import RayCoordinator
from layercheck.orchestrator.runtime.setup_errors import peer_gone, setup_failure
from layercheck.policies.configs import StaggeredConfig, drift_measured
from layercheck.policies.decision import PersistDecision

NUMEL = {"embed": 4000, "block.0": 1000, "block.1": 1000, "lm_head": 3000}
EVERY = 4
CONFIG = StaggeredConfig(period=4, drift_every=EVERY)


def _actor(*, rebuilt: bool, monkeypatch):
    monkeypatch.setattr(policy_actor, "_was_rebuilt", lambda: rebuilt)
    return policy_actor.PolicyActor.__ray_actor_class__(CONFIG, NUMEL, 2, 1)


async def _report(actor, step: int, rank: int):
    measured = drift_measured(step, EVERY)
    sums = {n: 1e-3 * size / 2 for n, size in NUMEL.items()} if measured else {}
    return await actor.report(step, rank, 1e-3, sums, {n: size // 2 for n, size in NUMEL.items()}, measured)


def _step(actor, step: int) -> list:
    async def both():
        return await asyncio.gather(_report(actor, step, 0), _report(actor, step, 1))

    return asyncio.run(both())


def test_a_rebuilt_actor_refuses_every_report_until_restarted_and_then_gives_every_rank_one_decision(monkeypatch):
    actor = _actor(rebuilt=True, monkeypatch=monkeypatch)
    assert actor.last_complete_step() is None  # its count died with the old process
    refused = _step(actor, 7)  # the lost group's reports, sent as the old process died
    assert all(answer["refused"] for answer in refused)
    assert not actor.service.trace and actor.service.last_complete_step == 0  # nothing was decided
    actor.restart(2, 6, {name: 4 for name in NUMEL})  # the next group resumes at 7 from versions at 4
    assert actor.last_complete_step() == 6
    for step in range(7, 15):
        zero, one = _step(actor, step)
        assert zero == one and zero["step"] == step and "refused" not in zero
    assert actor.last_complete_step() == 14


def test_an_actor_started_afresh_decides_as_before(monkeypatch):
    actor = _actor(rebuilt=False, monkeypatch=monkeypatch)
    assert actor.last_complete_step() == 0
    zero, one = _step(actor, 1)
    assert zero == one and zero["step"] == 1


class _Died(Future):
    """The answer of a call that died with the policy actor's process."""

    def __init__(self, error: BaseException) -> None:
        super().__init__()
        self.set_exception(error)


def _answered(value) -> Future:
    answer: Future = Future()
    answer.set_result(value)
    return answer


def _sent(answer: Future) -> Future:
    """The report as the sending thread hands it back: its answer's future."""
    return _answered(answer)


def _rank() -> RayCoordinator:
    return RayCoordinator(rank=1, policy=None, writer=None, supervisor=None, max_inflight_bytes=1)


@pytest.mark.parametrize(
    "error", [ray.exceptions.ActorDiedError(), ray.exceptions.ActorUnavailableError("restarting", None)]
)
def test_a_rank_whose_call_died_with_the_policy_actor_raises_policy_actor_lost(error):
    with pytest.raises(PolicyActorLost, match="rank 1: the policy actor died before it answered step 5") as lost:
        _rank().decision((5, _sent(_Died(error))))
    assert lost.value.__cause__ is error


def test_a_rank_refused_by_the_rebuilt_actor_raises_policy_actor_lost(monkeypatch):
    actor = _actor(rebuilt=True, monkeypatch=monkeypatch)
    (refusal, _) = _step(actor, 5)
    with pytest.raises(PolicyActorLost, match="rank 1: the policy actor was rebuilt"):
        _rank().decision((5, _sent(_answered(refusal))))


def test_a_rank_holding_the_old_actors_plan_carries_it_out_and_raises_at_the_next_answer_it_needs(monkeypatch):
    """The old actor answered measured step 1 with the plan of quiet steps 2-4 and died: the ranks
    carry out the same planned decisions without asking (every rank holds the same plan), and each
    raises at step 5, the first answer it collects, which only the dead actor could have given."""
    actor = _actor(rebuilt=False, monkeypatch=monkeypatch)
    answers = {1: _step(actor, 1)}
    ranks = [_rank(), _rank()]
    for rank, answer in zip(ranks, answers[1], strict=True):
        assert rank.decision((1, _sent(_answered(answer)))) == PersistDecision.from_json(answer)
    for step in (2, 3, 4):  # the rank holds these: nothing is collected (a dead call would raise)
        planned = [rank.decision((step, _sent(_Died(ray.exceptions.ActorDiedError())))) for rank in ranks]
        assert planned[0] == planned[1] and planned[0].step == step
    for rank in ranks:
        with pytest.raises(PolicyActorLost):
            rank.decision((5, _sent(_Died(ray.exceptions.ActorDiedError()))))


def test_a_lost_policy_actor_is_a_failure_to_recover_not_a_setup_error():
    """Before the run's first step too: the group is retried (the actor rebuilt), not ended."""
    lost = PolicyActorLost("rank 0: the policy actor died before it answered step 1 (ActorDiedError)")
    assert peer_gone(lost)
    assert setup_failure({0: lost, 1: lost}) is None
