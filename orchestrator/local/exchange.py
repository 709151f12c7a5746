"""How the ranks of a run under plain torch.distributed (:mod:`layercheck.orchestrator.local.local_coordinator`)
reach the same persist decisions without a policy actor: each keeps a replica of the run's
:class:`PolicyService` and feeds it every rank's drift report, exchanged among the ranks.

* **decisions**: ``report`` launches an asynchronous all_gather of every rank's per-layer drift
  sums and counts (on a gloo side group, so it never waits on the training stream) and returns at
  once; ``decision`` waits for that gather, feeds every rank's report to the replica and returns
  its decision. The policy is pure, so every replica decides the same, and as in the Ray runtime
  the loop collects step ``t``'s decision after step ``t + 1``
  (:data:`layercheck.workers.loop.DECISION_LAG`). A quiet step (:meth:`PolicyService.quiet`: no
  drift measured, news held for the next measured step) has nothing to exchange: each replica
  completes it alone, with the same result. Where the policy knows that such a step decides
  nothing (:meth:`PolicyService.decides_nothing`: most of them), the loop gets its empty decision
  at once and the replica completes it later, with the next step that may decide: the quiet steps'
  bookkeeping runs in one go, not a little of it between every two training steps, where the
  training step has left the CPU's caches cold.
* **write budget** (``budget``, from the run config's ``persistence.write_budget``; ``None``:
  off): each exchanged report also carries the rank's writer totals (bytes, write seconds) and its
  step time (:class:`RankNews`); every replica turns the gathered totals into the same budget
  (:class:`~layercheck.orchestrator.core.persistence.write_budget.DrainBudget`) and the policy service puts it
  on the step's observation, so a budget-aware schedule stretches its periods when storage is
  slower than its plan.
* **settlements**: a layer is persisted again only once its previous version has committed
  (:mod:`layercheck.orchestrator.core.persistence.persist_gate`). Rank 0's supervisor learns of commits
  through :class:`SettledAtNextReport`, which adds the newest settled version of each layer to
  rank 0's next exchanged report, so every replica applies the same settlements at the same step
  and the replicas never diverge.
* **memory period** (``persistence.memory_period = "auto"``): the period rank 0's supervisor chose
  rides on rank 0's exchanged reports the same way, so every replica's decisions carry it from the
  same step on (``core/memory/auto_period.py``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from layercheck.orchestrator.core.persistence.write_budget import DrainBudget
from layercheck.orchestrator.core.policy_service import PolicyService
from layercheck.orchestrator.core.supervision_ports import LocalPolicy
from layercheck.orchestrator.local.writers_port import writer_name
from layercheck.policies.decision import PersistDecision
from layercheck.workers.drift.probe import LayerDrift

logger = logging.getLogger(__name__)


class RankNews(NamedTuple):
    """What a rank's exchanged report carries beside its drift."""

    settled: list[float]
    """Per layer, the newest version step rank 0's supervisor saw settle (-1: none; other ranks: all -1)."""
    written_bytes: float
    """The rank's writer's totals so far: bytes written and seconds spent writing."""
    write_s: float
    step_s: float
    """The rank's last step time (compute, stall and coordination)."""
    memory_period: float = -1.0
    """The memory versions' period rank 0's supervisor chose (``"auto"``; -1: none, other ranks: -1)."""


class SettledAtNextReport(LocalPolicy):
    """Rank 0's policy port: settlements wait for the next drift report, which carries them to
    every replica (its own included), instead of reaching rank 0's replica first."""

    def __init__(self, service: PolicyService) -> None:
        super().__init__(service)
        self._lock = threading.Lock()
        self._newest: dict[str, int] = {}
        self._memory_period = -1

    def set_memory_period(self, period: int) -> None:
        """Carried to every replica by rank 0's next exchanged report, like a settlement."""
        with self._lock:
            self._memory_period = period

    def memory_period(self) -> float:
        """The period to carry (-1: none chosen); sent with every report once chosen (idempotent)."""
        with self._lock:
            return float(self._memory_period)

    def settled(self, layer: str, version_step: int) -> None:
        with self._lock:
            self._newest[layer] = max(version_step, self._newest.get(layer, -1))

    def newest(self, layers: Sequence[str]) -> list[float]:
        with self._lock:
            return [float(self._newest.get(name, -1)) for name in layers]


@dataclass
class _Gather:
    step: int
    lr: float
    work: Any
    gathered: list[torch.Tensor]


class DecisionExchange:
    """One rank's side of the exchange: its reports out, every rank's reports into ``service``
    (this rank's policy replica), in step order. ``group``: the gloo side group of the ranks."""

    def __init__(
        self,
        service: PolicyService,
        layers: Sequence[str],
        world_size: int,
        group: torch.distributed.ProcessGroup,
        *,
        budget: DrainBudget | None = None,
    ) -> None:
        self.service = service
        self.layers = tuple(layers)
        self.world_size = world_size
        self._group = group
        self._budget = budget
        self._gathers: dict[int, _Gather | float] = {}
        """Per reported step not yet fed to the replica: its gather, or a quiet step's learning rate."""
        self._answered_empty = 0
        """The last quiet step whose decision the loop got before the replica completed it (empty)."""

    def report(self, drift: LayerDrift, lr: float, *, news: Callable[[], RankNews]) -> int:
        """Send this rank's report of ``drift.step`` (``news()`` read only for a step exchanged);
        the handle of its decision."""
        if self.service.quiet(drift.step):  # nothing measured, no news: nothing to exchange
            self._gathers[drift.step] = lr
            return drift.step
        extra = news()
        width = max(len(self.layers), 5)  # row 3 holds five numbers; rows 0-2 are read up to len(layers)

        def row(values: Sequence[float]) -> list[float]:
            return [*values, *[0.0] * (width - len(values))]

        mine = torch.tensor(
            [
                row([float(drift.l1.get(n, 0.0)) for n in self.layers]),
                row([float(drift.numel.get(n, 0)) for n in self.layers]),
                row(extra.settled),
                row([extra.written_bytes, extra.write_s, extra.step_s, float(drift.measured), extra.memory_period]),
            ],
            dtype=torch.float64,
        )
        gathered = [torch.empty_like(mine) for _ in range(self.world_size)]
        work = dist.all_gather(gathered, mine, group=self._group, async_op=True)
        self._gathers[drift.step] = _Gather(drift.step, lr, work, gathered)
        return drift.step

    def decision(self, handle: int) -> PersistDecision | None:
        """The replica's decision for the step of ``handle`` (every rank's the same)."""
        if self.service.decides_nothing(handle):  # completed later, with the next step that may decide
            self._answered_empty = handle
            return PersistDecision(step=handle)
        self.settle(up_to=handle)
        return self.service.decision(handle)

    def settle(self, up_to: int | None = None) -> None:
        """Wait for the gathers of every reported step (up to ``up_to``), in order, and feed them
        to the policy replica."""
        for step in sorted(self._gathers):
            if up_to is not None and step > up_to:
                break
            gather = self._gathers.pop(step)
            if not isinstance(gather, _Gather):  # a quiet step: every replica completes it alone
                decided = self.service.complete_quiet(step, gather)
                if decided and step <= self._answered_empty:
                    logger.error("step %d: decided %s after the loop was told it decides nothing", step, decided)
                continue
            gather.work.wait()
            for name, version_step in zip(self.layers, gather.gathered[0][2].tolist()):
                if version_step >= 0:  # rank 0's settlements, applied by every replica before this step's decision
                    self.service.settled(name, int(version_step))
            if (period := gather.gathered[0][3][4].item()) >= 0:  # rank 0's chosen period, likewise
                self.service.set_memory_period(int(period))
            if self._budget is not None:  # from gathered values only: every replica computes the same
                totals = [both[3].tolist() for both in gather.gathered]
                self.service.set_write_budget(
                    self._budget.update(
                        {writer_name(rank): (t[0], t[1]) for rank, t in enumerate(totals)},
                        step_s=max(t[2] for t in totals),
                    )
                )
            for rank, both in enumerate(gather.gathered):
                self.service.report(
                    step=step,
                    rank=rank,
                    lr=gather.lr,
                    abs_sums=dict(zip(self.layers, both[0].tolist())),
                    counts={n: int(c) for n, c in zip(self.layers, both[1].tolist())},
                    measured=bool(both[3][3]),
                )

    def forget(self) -> None:
        """Drop every report not yet fed to the replica: a new worker group starts its steps anew
        (the replica is rebased by its caller)."""
        self._gathers.clear()
        self._answered_empty = 0
