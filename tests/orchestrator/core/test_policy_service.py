"""The policy service (``layercheck.orchestrator.core.policy_service``): every rank's drift report
for a step in, one decision out, from the global mean drift; duplicate and late reports; a
restart rebases the policy on the composite (or starts over without one)."""

import pytest

from layercheck.orchestrator.core.policy_service import DECISION_HISTORY, PolicyService
from layercheck.policies.checkpoint_policy import LayerCheckPolicy
from layercheck.policies.configs import LayerCheckConfig
from layercheck.policies.decision import Reason

LAYERS = ("embed", "block.0", "norm")


def service(world_size=2, **policy):
    config = LayerCheckConfig(
        **{"k0": 1.0, "k0_embed": 1.0, "smax": 100, "warmup_steps": 1, "threshold_schedule": "constant", **policy}
    )
    return PolicyService(LayerCheckPolicy(config, LAYERS), LAYERS, world_size)


def report(svc, step, rank, sums, counts=None):
    counts = counts or {name: 10 for name in LAYERS}
    return svc.report(step=step, rank=rank, lr=1e-3, abs_sums=dict(zip(LAYERS, sums)), counts=counts)


def test_decision_comes_when_the_last_rank_reports_and_drift_is_the_global_mean():
    svc = service()
    assert report(svc, 1, 0, [0, 0, 0]) is None
    assert report(svc, 1, 1, [0, 0, 0]).is_base  # warm-up ends at step 1
    for layer in svc.layers:
        svc.settled(layer, 2)  # the base's versions (taken after step 2) committed
    assert report(svc, 2, 1, [4.0, 1.0, 0.0]) is None
    decision = report(svc, 2, 0, [6.0, 1.0, 0.0])
    # embed: (6 + 4) / (10 + 10) = 0.5 < 1; then another 0.5 reaches the threshold
    assert svc.trace[-1].drift == {"embed": 0.5, "block.0": 0.1, "norm": 0.0}
    assert not decision
    report(svc, 3, 0, [10.0, 0, 0])
    assert report(svc, 3, 1, [0.0, 0, 0]).reasons == {"embed": Reason.DRIFT}
    assert svc.last_complete_step == 3 and svc.decision(3) is not None


def test_duplicate_and_out_of_world_reports():
    svc = service()
    report(svc, 1, 0, [0, 0, 0])
    assert report(svc, 1, 0, [9, 9, 9]) is None  # the same rank again changes nothing
    assert report(svc, 1, 1, [0, 0, 0]) is not None
    assert report(svc, 1, 1, [0, 0, 0]) == svc.decision(1)  # a late retry gets the same decision
    with pytest.raises(ValueError, match="outside the world"):
        report(svc, 2, 5, [0, 0, 0])


def test_restart_rebases_the_policy_on_the_composite():
    svc = service(smax=5)
    for step in range(1, 4):
        report(svc, step, 0, [3, 3, 3])
        report(svc, step, 1, [3, 3, 3])
    report(svc, 4, 0, [0.1, 0.1, 0.1])  # rank 1 died before reporting step 4
    svc.restart(world_size=1, resume_after=3, persisted_steps={"embed": 2, "block.0": 1, "norm": 2})
    state = svc.policy.state_dict()
    assert state["last_persisted"] == {"embed": 2, "block.0": 1, "norm": 2}
    assert state["accumulated"] == {name: 0.0 for name in LAYERS}
    assert svc.last_complete_step == 3
    # the new one-rank group reports step 4 afresh; block.0 is 5 steps stale at step 6
    report(svc, 4, 0, [0, 0, 0])
    report(svc, 5, 0, [0, 0, 0])
    assert report(svc, 6, 0, [0, 0, 0]).reasons == {"block.0": Reason.STALENESS}


def test_restart_without_a_composite_starts_over_and_rewrites_the_base():
    svc = service(warmup_steps=2)
    for step in (1, 2, 3):
        report(svc, step, 0, [0, 0, 0])
        report(svc, step, 1, [0, 0, 0])
    svc.restart(world_size=2, resume_after=0, persisted_steps={})
    assert svc.last_complete_step == 0 and svc.trace == []
    report(svc, 1, 0, [0, 0, 0])
    assert not report(svc, 1, 1, [0, 0, 0])
    report(svc, 2, 0, [0, 0, 0])
    assert report(svc, 2, 1, [0, 0, 0]).is_base


def test_the_last_decision_history_steps_are_kept_across_a_restart_to_an_earlier_step():
    svc = service(world_size=1)
    last = 2 * DECISION_HISTORY
    for step in range(1, last + 1):
        report(svc, step, 0, [0, 0, 0])
    kept = [s for s in range(1, last + 1) if svc.decision(s) is not None]
    assert kept == list(range(last - DECISION_HISTORY + 1, last + 1))
    svc.restart(world_size=1, resume_after=last - 10, persisted_steps={})  # the 10 after it are lost
    for step in range(last - 9, last + 41):
        report(svc, step, 0, [0, 0, 0])
    kept = [s for s in range(1, last + 41) if svc.decision(s) is not None]
    assert kept == list(range(last + 40 - DECISION_HISTORY + 1, last + 41))
