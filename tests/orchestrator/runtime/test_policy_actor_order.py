"""Ray runs an asynchronous actor's calls out of the order one caller made them: it ran a rank's
report of step 2 before its report of step 1, so step 2 completed first, step 1 never did, and the
other rank waited for step 1's decision for good (a CI hang). The policy actor takes each rank's
reports in step order. Its class is driven here without Ray, its reports as coroutines."""

from __future__ import annotations

import asyncio

from layercheck.orchestrator.runtime import policy_actor
from layercheck.policies.configs import IntervalConfig

NUMEL = {"embed": 100, "norm": 10}
SUMS = {name: 1e-3 * size for name, size in NUMEL.items()}


def _actor(world_size: int = 2):
    return policy_actor.PolicyActor.__ray_actor_class__(IntervalConfig(interval=1), NUMEL, world_size, 4)


def test_a_ranks_report_that_overtakes_its_previous_one_waits_for_it():
    actor = _actor()

    async def run():
        def report(step: int, rank: int):
            return asyncio.create_task(actor.report(step, rank, 1e-3, SUMS, NUMEL))

        rank0 = [report(1, 0), report(2, 0)]
        early = report(2, 1)  # rank 1's step 2 arrives before its step 1
        await asyncio.sleep(0.05)
        assert actor.service.last_complete_step == 0, "step 2 was taken before step 1"
        late = report(1, 1)
        return await asyncio.gather(*rank0, late, early)

    one, two, late, early = asyncio.run(run())
    assert [one["step"], two["step"], late["step"], early["step"]] == [1, 2, 1, 2]
    assert [o.step for o in actor.service.trace] == [1, 2]  # no step skipped


def test_a_report_held_for_a_lost_group_is_dropped_when_the_next_group_starts():
    actor = _actor()

    async def run():
        held = asyncio.create_task(actor.report(3, 1, 1e-3, SUMS, NUMEL))  # its step 1 and 2 never come
        await asyncio.sleep(0.05)
        assert not held.done()
        actor.restart(2, 0, {})  # the group was lost before step 1 completed: a new one starts at 1
        assert await asyncio.wait_for(held, 5) is None
        fresh = [asyncio.create_task(actor.report(1, r, 1e-3, SUMS, NUMEL)) for r in (0, 1)]
        return await asyncio.gather(*fresh)

    answers = asyncio.run(run())
    assert [a["step"] for a in answers] == [1, 1]


def test_a_report_whose_predecessor_is_lost_is_taken_after_a_bound(monkeypatch):
    monkeypatch.setattr(policy_actor, "REPORT_ORDER_WAIT_S", 0.1)
    actor = _actor(world_size=1)
    answer = asyncio.run(actor.report(2, 0, 1e-3, SUMS, NUMEL))  # step 1's report never comes
    assert answer["step"] == 2
