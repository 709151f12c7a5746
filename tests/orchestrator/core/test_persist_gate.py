"""One version of a layer in flight at a time: the gate between the policy and the writers."""

from layercheck.orchestrator.core.persistence.persist_gate import PersistGate
from layercheck.orchestrator.core.policy_service import PolicyService
from layercheck.policies.checkpoint_policy import build_policy
from layercheck.policies.configs import IntervalConfig
from layercheck.policies.decision import PersistDecision, Reason

LAYERS = {"embed": 10, "block.0": 20, "lm_head": 10}


def _decide(gate: PersistGate, step: int, *names: str, reason: Reason = Reason.DRIFT) -> tuple[str, ...]:
    return gate.admit(PersistDecision.of(step, {n: reason for n in names})).names


def test_a_layer_in_flight_is_held_back_until_its_version_settles():
    gate = PersistGate()
    assert _decide(gate, 1, "embed", "block.0") == ("embed", "block.0")
    assert _decide(gate, 2, "embed", "block.0", "lm_head") == ("lm_head",)  # embed, block.0 in flight
    assert gate.deferred == {"embed": Reason.DRIFT, "block.0": Reason.DRIFT} and gate.deferrals == 2
    gate.settled("embed", 2)  # the version of the step-1 decision (taken one step later) committed
    assert _decide(gate, 3) == ("embed",)  # the deferred layer joins the next decision, with its reason
    assert gate.deferred == {"block.0": Reason.DRIFT}


def test_a_late_settlement_of_an_older_version_frees_nothing():
    gate = PersistGate()
    _decide(gate, 5, "embed")
    gate.settled("embed", 4)  # an older version, settled late
    assert _decide(gate, 6, "embed") == ()
    gate.settled("embed", 6)
    assert _decide(gate, 7) == ("embed",)


def test_a_deferred_layer_keeps_the_reason_it_was_asked_for_with():
    gate = PersistGate()
    _decide(gate, 1, "embed", reason=Reason.BASE)
    _decide(gate, 2, "embed", reason=Reason.STALENESS)
    gate.settled("embed", 2)
    decision = gate.admit(PersistDecision(step=3))
    assert decision.reasons == {"embed": Reason.STALENESS}


def test_a_new_worker_group_starts_with_nothing_in_flight():
    gate = PersistGate()
    _decide(gate, 1, "embed")
    _decide(gate, 2, "embed")
    gate.reset()
    assert _decide(gate, 3, "embed") == ("embed",) and not gate.deferred


def test_the_policy_service_gates_every_decision_and_hears_settlements():
    service = PolicyService(build_policy(IntervalConfig(interval=1), LAYERS), list(LAYERS), world_size=2)

    def step(t: int) -> tuple[str, ...]:
        service.report(step=t, rank=0, lr=1e-3, abs_sums={}, counts={})
        return service.report(step=t, rank=1, lr=1e-3, abs_sums={}, counts={}).names

    assert step(1) == tuple(LAYERS)
    assert step(2) == ()  # storage has not committed step 1's versions: nothing is piled up behind them
    service.settled("block.0", 2)
    assert step(3) == ("block.0",)
    for name in LAYERS:
        service.settled(name, 4)
    assert step(4) == tuple(LAYERS)
    service.restart(world_size=2, resume_after=4, persisted_steps={n: 4 for n in LAYERS})
    assert step(5) == tuple(LAYERS)
