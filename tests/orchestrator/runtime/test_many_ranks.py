"""The control actors of a run of more ranks than Ray lets an actor run calls at once by default,
as ``bench/scale`` drives them. The supervisor (64 threads): every rank of an in-place run waits at
the rendezvous in a call of its own until all have arrived (``rendezvous.py``), so the actor runs
one such call per rank at once (with 64, 80 ranks never formed a group); and every rank's ``join``
is answered with one ``ResumeInfo`` in the object store, not a copy pickled per rank
(``resume_ref.py``). The policy actor (1000 coroutines): each rank's report waits in it until every
rank's report of the step is in (with 1000, 1,100 ranks never got a decision)."""

import pytest
import ray

from layercheck.orchestrator.core.persistence.config import PersistenceConfig
from layercheck.orchestrator.core.recovery.events import ResumeInfo
from layercheck.orchestrator.core.run_config import MetricsConfig
from layercheck.orchestrator.runtime.driver import start_run
from layercheck.orchestrator.runtime.resume_ref import resume_of
from layercheck.policies.configs import StaggeredConfig

pytestmark = pytest.mark.slow

RANKS = 80  # past the 64 threads a Ray actor ran before (OTHER_THREADS)


def _run(tmp_path):
    return start_run(
        name="many-ranks",
        storage_uri=str(tmp_path / "store"),
        policy=StaggeredConfig(period=4),
        persistence=PersistenceConfig(fsync=False, memory_period=0),
        metrics=MetricsConfig(port=0, discovery_dir=""),
        num_workers=RANKS,
        layer_numel={"embed": 8, "block.0": 8},
        in_place=True,
    )


def test_every_rank_of_a_large_group_meets_at_the_rendezvous_and_gets_one_shared_answer(local_ray, tmp_path):
    handles = _run(tmp_path)
    try:
        calls = [handles.supervisor.rendezvous.remote(rank, RANKS, "127.0.0.1", 4000, 60.0) for rank in range(RANKS)]
        formed = ray.get(calls, timeout=120)
        assert {address.generation for address in formed} == {1}
        assert {address.world_size for address in formed} == {RANKS}
        answers = ray.get([handles.supervisor.join.remote(rank, RANKS, f"w{rank}") for rank in range(RANKS)])
        assert all(isinstance(answer, ray.ObjectRef) for answer in answers)
        assert len({answer.hex() for answer in answers}) == 1  # one object, every rank's reference to it
        assert resume_of(answers[0]) == ResumeInfo(1, 1)
    finally:
        ray.kill(handles.supervisor)
        ray.kill(handles.policy)


def test_every_rank_of_a_group_past_a_thousand_ranks_gets_its_decision(local_ray, tmp_path):
    from layercheck.orchestrator.runtime.policy_actor import PolicyActor

    ranks = 1100  # past the 1000 calls a Ray async actor ran before (MAX_CALLS)
    numel = {"embed": 8, "block.0": 8}
    policy = PolicyActor.remote(StaggeredConfig(period=4), numel, ranks)
    try:
        l1, counts = dict.fromkeys(numel, 1e-6), dict.fromkeys(numel, 8)
        reports = [policy.report.remote(1, rank, 1e-5, l1, counts) for rank in range(ranks)]
        done, pending = ray.wait(reports, num_returns=ranks, timeout=180)
        assert not pending, f"{len(pending)} of {ranks} ranks never got step 1's decision"
        assert {answer["step"] for answer in ray.get(done)} == {1}
        assert ray.get(policy.last_complete_step.remote()) == 1
    finally:
        ray.kill(policy)
