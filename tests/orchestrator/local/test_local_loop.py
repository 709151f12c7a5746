"""``layercheck.workers.loop.run_loop`` through the local (no Ray) coordinator, on 2 real gloo ranks:
decisions carried out one step late on every rank alike, only whole versions committed, the
layers a decision names are the ones persisted, and a failure + recovery resumes at
``t_fail + 1`` with the losses of a failure-free run when every layer is persisted every step.
Commits and recovery go through rank 0's ``RunSupervisor`` (the Ray runtime's cores): a failed
commit is retried, and a version found corrupt at recovery is replanned around."""

from __future__ import annotations

import math

import pytest

from tests.support.local_jobs import STEPS

pytestmark = pytest.mark.slow  # spawns DeepSpeed ranks (~30 s on 2 cores)


@pytest.fixture(scope="module")
def ranks(local_runtime):
    """The loop scenarios' results (spawned with the write-budget job: tests/conftest.py)."""
    return local_runtime["loop"]


def test_the_layers_a_decision_names_are_persisted_one_step_later_on_every_rank(ranks):
    layers = ranks[0]["layers"]
    for out in ranks:
        # decided at steps 2 and 3, carried out after steps 3 and 4 (DECISION_LAG = 1)
        assert out["scripted"]["handed"] == [[3, [layers[0]]], [4, [layers[1], layers[-1]]]]
    assert [[layer, step] for layer, step, _ in ranks[0]["scripted"]["manifest"]] == sorted(
        [[layers[0], 3], [layers[1], 4], [layers[-1], 4]]
    )
    status = ranks[0]["scripted"]["status"]
    assert status["state"] == "finished" and status["versions_committed"] == 3 and status["lost_versions"] == 0


def test_every_rank_decides_alike_and_only_whole_versions_are_committed(ranks):
    assert ranks[0]["every"]["decided"] == ranks[1]["every"]["decided"]
    assert ranks[0]["every"]["handed"] == ranks[1]["every"]["handed"]
    # interval 1: the decision of step t after step t+1, the last one when the loop ends
    assert [step for step, _ in ranks[0]["every"]["handed"]] == [*range(2, STEPS + 1), STEPS]
    manifest = ranks[0]["every"]["manifest"]
    assert manifest and all(shard_ranks == [0, 1] for _, _, shard_ranks in manifest)
    assert ranks[0]["every"]["status"]["versions_committed"] == len(manifest)
    assert all(out["every"]["drained"] for out in ranks)


def test_failure_and_recovery_resume_at_t_fail_plus_one_with_the_same_losses(ranks):
    layers = ranks[0]["layers"]
    for out in ranks:
        (recovery,) = out["failed"]["recoveries"]
        assert recovery["t_fail"] == 4 and recovery["start_step"] == 5
        # the decision of step 3 was carried out after step 4: the composite is step 4's state
        assert recovery["versions"] == {layer: 4 for layer in layers}
    assert ranks[0]["failed"]["losses"] == ranks[0]["every"]["losses"]
    assert sorted(map(int, ranks[0]["failed"]["losses"])) == list(range(1, STEPS + 1))
    # the supervisor accounted it as under Ray: one lost group, attempt 2, resumed at t_fail + 1
    status, account = ranks[0]["failed"]["status"], ranks[0]["failed"]["account"]
    assert status["state"] == "finished" and status["attempt"] == 2 and status["step"] == STEPS
    assert account["failures"] == 1
    (record,) = account["recoveries"]
    assert (record["t_fail"], record["resumed_at"], record["max_staleness"]) == (4, 5, 0)


def test_a_commit_that_fails_is_retried_by_the_supervisor(ranks):
    layers = ranks[0]["layers"]
    status = ranks[0]["retried"]["status"]
    assert status["commit_retries"] == 1 and status["lost_versions"] == 0
    assert [[layer, step] for layer, step, _ in ranks[0]["retried"]["manifest"]] == [[layers[0], 3]]


def test_a_corrupt_newest_version_at_recovery_falls_back_to_the_previous_one(ranks):
    layers = ranks[0]["layers"]
    for out in ranks:  # only rank 1 read the damaged shard; every rank agreed and replanned
        (recovery,) = out["corrupt"]["recoveries"]
        assert recovery["t_fail"] == 4 and recovery["start_step"] == 5
        assert recovery["versions"] == {layer: 3 if layer == layers[1] else 4 for layer in layers}
        assert len(recovery["unusable"]) == 1 and recovery["unusable"][0].startswith(f"{layers[1]}@0000000004")
    losses = ranks[0]["corrupt"]["losses"]
    assert sorted(map(int, losses)) == list(range(1, STEPS + 1))
    assert all(math.isfinite(loss) for loss in losses.values())  # nothing of the garbage load is left
    # as a Ray group that dies on a corrupt shard: the replan is another attempt
    assert ranks[0]["corrupt"]["status"]["attempt"] == 3


def test_the_default_staggered_schedule_hands_over_slices_and_recovers_from_its_first_versions(ranks):
    layers = ranks[0]["layers"]
    out = ranks[0]["staggered"]
    assert out["handed"] == ranks[1]["staggered"]["handed"]
    first = {}
    for step, names in out["handed"]:
        for name in names:
            first.setdefault(name, step)
    # period 3 from step 1: every layer's first version decided at steps 1..3, handed over a step later,
    # a slice at a time (never the whole model at once)
    assert set(first) == set(layers) and max(first.values()) <= 4
    assert all(len(names) < len(layers) for _, names in out["handed"])
    for rank_out in ranks:
        (recovery,) = rank_out["staggered"]["recoveries"]
        assert recovery["t_fail"] == 4 and recovery["start_step"] == 5
        assert set(recovery["versions"]) == set(layers)
