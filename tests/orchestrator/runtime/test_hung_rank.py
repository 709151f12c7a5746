"""A rank that stops reporting (hung, not dead) ends in a clear error on the ranks waiting for it,
never in a silent stall (issue 59): the real policy actor and the ranks' real coordinators."""

import logging
import threading

import pytest

from layercheck.orchestrator.runtime.fit_watch import RunHandles, announce_stall
from layercheck.orchestrator.runtime.policy_actor import PolicyActor
from layercheck.orchestrator.runtime.ray_coordinator import RankHung, RayCoordinator
from layercheck.policies.configs import IntervalConfig
from layercheck.workers.drift.probe import LayerDrift
from tests.support.statuses import a_status

NUMEL = {"embed": 10}


def _drift(step: int) -> LayerDrift:
    return LayerDrift(step=step, l1={"embed": 0.1}, numel=NUMEL, measured=True)


def test_ranks_waiting_on_a_hung_rank_name_it_and_fail_instead_of_stalling(local_ray, caplog):
    """Three ranks report step 1; rank 1 then hangs and never reports step 2. Ranks 0 and 2 wait
    for step 2's decision for ``decision_timeout_s``, then raise :class:`RankHung` naming rank 1
    and the last step it reported (a ``TimeoutError``: the group fails and is recovered, the hung
    process replaced with it), each within a bounded time. The driver's stall notice names it too."""
    import ray

    policy = PolicyActor.remote(IntervalConfig(interval=1), NUMEL, 3, 4)
    ranks = [
        RayCoordinator(
            rank=r, policy=policy, writer=None, supervisor=None, max_inflight_bytes=1, decision_timeout_s=1.0
        )
        for r in range(3)
    ]
    try:
        firsts = [rank.report(_drift(1), 1e-3) for rank in ranks]
        assert all(rank.decision(handle) is not None for rank, handle in zip(ranks, firsts))  # step 1: all in
        errors: dict[int, BaseException] = {}

        def wait_for_step_2(rank: RayCoordinator) -> None:
            try:
                rank.decision(rank.report(_drift(2), 1e-3))
            except BaseException as error:  # noqa: BLE001 - what the test looks at
                errors[rank.rank] = error

        waiting = [threading.Thread(target=wait_for_step_2, args=(ranks[r],)) for r in (0, 2)]
        for thread in waiting:
            thread.start()
        for thread in waiting:
            thread.join(timeout=60)
        assert not any(thread.is_alive() for thread in waiting), "a rank still waits on the hung one"
        assert sorted(errors) == [0, 2]
        for rank, error in errors.items():
            assert isinstance(error, RankHung) and isinstance(error, TimeoutError)
            assert f"rank {rank}: no decision for step 2 in 1s" in str(error)
            assert "never reported by rank 1 (last reported step 1): hung, not dead" in str(error)
        assert ray.get(policy.missing_reports.remote(2)) == {1: 1}
        assert ray.get(policy.missing_reports.remote(1)) == {}  # complete: nobody missing
        handles = RunHandles(
            run_id="r",
            storage_uri="",
            policy_config=IntervalConfig(interval=1),
            layer_numel=NUMEL,
            policy=policy,
            supervisor=None,
            metrics_url=None,
        )
        with caplog.at_level(logging.ERROR):
            announce_stall(handles, a_status(step=1, world_size=3), 700.0)
        assert (
            "no step completed for 700s (the last: step 1); rank 1 (last reported step 1) never reported step 2"
            in caplog.text
        )
    finally:
        ray.kill(policy)


@pytest.mark.parametrize("timeout", [0.0, -1.0])
def test_a_decision_timeout_that_is_not_positive_is_refused(timeout):
    from layercheck.orchestrator.core.persistence.config import PersistenceConfig

    with pytest.raises(ValueError, match="decision_timeout_s"):
        PersistenceConfig(decision_timeout_s=timeout)
