"""The loop's memory versions under ``persistence.memory_period = "auto"``: a rank starts with the
coordinator's period and takes the one each decision carries from the step it carries it out at
(every rank carries out the same decision at the same step, so all switch together); rank 0's
progress says what its memory versions cost, which the run times to choose the period."""

from __future__ import annotations

import torch

from layercheck.policies.decision import PersistDecision
from layercheck.workers import loop
from layercheck.workers.drift.probe import LayerDrift
from layercheck.workers.layout import StateLayout
from tests.support.layouts import one_layer_layout


def stepped_layout() -> StateLayout:
    param = torch.nn.Parameter(torch.zeros(4))
    optimizer = torch.optim.AdamW([param])
    param.grad = torch.ones(4)
    optimizer.step()  # the moments a snapshot takes exist
    return one_layer_layout(param, optimizer)


class Coordinator:
    """Keeps memory versions (``KeepsMemoryVersions``); decisions carry the scripted periods."""

    def __init__(self, periods: dict[int, int | None], clock: list[float]) -> None:
        self.periods = periods
        self.clock = clock
        self.memory_period = 0  # "auto": nothing until a decision carries the run's period
        self.held: list[int] = []
        self.progress_log: list = []

    def report(self, drift, lr):
        return drift.step

    def decision(self, step):
        return PersistDecision(step=step, memory_period=self.periods.get(step))

    def persist(self, shards, *, base):
        pass

    def hold(self, shards):
        self.held.append(shards[0].step)
        self.clock[0] += 0.002  # the hand-over

    def progress(self, progress):
        self.progress_log.append(progress)


def test_a_rank_takes_memory_versions_at_the_period_its_decisions_carry(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(loop.time, "monotonic", lambda: clock[0])
    # decision 1 (carried out at step 2) starts the tentative every-step period, decision 5 the chosen 3
    coordinator = Coordinator({**dict.fromkeys(range(1, 5), 1), **dict.fromkeys(range(5, 12), 3)}, clock)
    protocol = loop.StepProtocol(stepped_layout(), coordinator, rank=0)
    for t in range(1, 13):
        protocol.after_step(t, LayerDrift(step=t, l1={}, numel={}, measured=False), loss=1.0, lr=0.1, compute_s=0.1)
    assert coordinator.held == [2, 3, 4, 5, 6, 9, 12]
    assert sorted(protocol.result.held) == coordinator.held
    # what each memory version cost on the training thread, in rank 0's progress of its step
    memory_s = {p.step: p.memory_s for p in coordinator.progress_log}
    assert {step for step, cost in memory_s.items() if cost} == set(coordinator.held)
    assert all(memory_s[step] == 0.002 for step in coordinator.held)
    assert all(p.stall_s >= p.memory_s for p in coordinator.progress_log)


def test_a_decision_without_a_period_leaves_the_rank_at_its_own():
    coordinator = Coordinator({}, [0.0])
    coordinator.memory_period = 2  # set by the config: decisions carry none
    protocol = loop.StepProtocol(stepped_layout(), coordinator, rank=0)
    for t in range(1, 7):
        protocol.after_step(t, LayerDrift(step=t, l1={}, numel={}, measured=False), loss=1.0, lr=0.1, compute_s=0.1)
    assert coordinator.held == [2, 4, 6]
