"""The :class:`workers.loop.Coordinator` of a run under plain torch.distributed, no Ray.

It runs the Ray runtime's protocol with the same cores, spread over the ranks instead of actors:

* **decisions**: every rank keeps a replica of the :class:`PolicyService`. ``report`` launches an
  asynchronous all_gather of every rank's per-layer drift sums and counts (on a gloo side group,
  so it never waits on the training stream) and returns at once; ``decision`` waits for that
  gather, feeds every rank's report to the replica and returns its decision. The policy is pure,
  so every replica decides the same, and as in the Ray runtime the loop collects step ``t``'s
  decision after step ``t + 1`` (:data:`workers.loop.DECISION_LAG`).
* **writes**: each rank's :class:`LocalWriter` thread drains a superseding queue into
  ``LayerStore.write_shard`` under the in-flight byte bound (``PersistenceConfig.max_inflight_bytes``).
* **commits**: receipts reach rank 0's :class:`Committer` through an in-memory :class:`Mailbox`;
  it commits whole versions with the :class:`CommitTracker`.

Recovery after a failure lives in :mod:`orchestrator.local.recovery`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist

from orchestrator.core.policy_service import PolicyService
from orchestrator.local.committer import Committer
from orchestrator.local.mailbox import Mailbox
from orchestrator.local.writer import LocalWriter
from orchestrator.store.layer_store import LayerStore
from policies.checkpoint_policy import CheckpointPolicy
from policies.decision import PersistDecision
from workers.drift import LayerDrift
from workers.shard import LayerShard

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepProgress:
    """Rank 0's report of one step (what the Ray supervisor's ``progress`` receives)."""

    step: int
    loss: float
    lr: float
    compute_s: float
    stall_s: float
    coordination_s: float


@dataclass
class _Gather:
    step: int
    lr: float
    work: Any
    gathered: list[torch.Tensor]


class LocalCoordinator:
    """One rank's coordinator; every rank of the group constructs one (collectively)."""

    def __init__(self, *, policy: CheckpointPolicy, layers: Sequence[str], store: LayerStore,
                 max_inflight_bytes: int) -> None:
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.layers = tuple(layers)
        self.service = PolicyService(policy, self.layers, self.world_size)
        self.store = store
        self._group = dist.new_group(backend="gloo")  # small CPU tensors, off the training stream
        self.mailbox = Mailbox.create()
        self.writer = LocalWriter(store, self.mailbox, max_inflight_bytes=max_inflight_bytes)
        self.committer = Committer(store, self.mailbox) if self.rank == 0 else None
        self._gathers: dict[int, _Gather] = {}
        self.handed: list[tuple[int, tuple[str, ...]]] = []
        """(step, layers) of every snapshot handed to the writer, in order."""
        self.progress_log: list[StepProgress] = []

    # ---- workers.loop.Coordinator ----------------------------------------------------------
    def report(self, drift: LayerDrift, lr: float) -> int:
        mine = torch.tensor([[float(drift.l1.get(n, 0.0)) for n in self.layers],
                             [float(drift.numel.get(n, 0)) for n in self.layers]], dtype=torch.float64)
        gathered = [torch.empty_like(mine) for _ in range(self.world_size)]
        work = dist.all_gather(gathered, mine, group=self._group, async_op=True)
        self._gathers[drift.step] = _Gather(drift.step, lr, work, gathered)
        return drift.step

    def decision(self, handle: int) -> PersistDecision | None:
        self._settle(up_to=handle)
        return self.service.decision(handle)

    def persist(self, shards: Sequence[LayerShard], *, base: bool) -> None:
        for shard in shards:
            # the loop reuses the buffers once this returns: the writer gets its own copy
            owned = replace(shard, tensors={k: v.clone() for k, v in shard.tensors.items()})
            self.writer.submit(owned, base=base)
        if shards:
            self.handed.append((shards[0].step, tuple(s.layer for s in shards)))

    def progress(self, *, step: int, loss: float, lr: float, compute_s: float, stall_s: float,
                 coordination_s: float) -> None:
        self.progress_log.append(StepProgress(step, loss, lr, compute_s, stall_s, coordination_s))

    # ---- the rest of the protocol ----------------------------------------------------------
    def _settle(self, up_to: int | None = None) -> None:
        """Wait for the gathers of every reported step (up to ``up_to``), in order, and feed them
        to the policy replica."""
        for step in sorted(self._gathers):
            if up_to is not None and step > up_to:
                break
            gather = self._gathers.pop(step)
            gather.work.wait()
            for rank, both in enumerate(gather.gathered):
                self.service.report(step=step, rank=rank, lr=gather.lr,
                                    abs_sums=dict(zip(self.layers, both[0].tolist())),
                                    counts={n: int(c) for n, c in zip(self.layers, both[1].tolist())})

    def last_complete_step(self) -> int:
        """Every rank's report gathered: the last step all ranks completed (``t_fail`` after a
        failure). Collective: every rank calls it at the same point."""
        self._settle()
        return self.service.last_complete_step

    def drain(self, timeout_s: float) -> bool:
        """Every rank's writer finishes what it holds and rank 0 commits what is whole (a
        collective); False if a writer or the committer missed the deadline."""
        drained = self.writer.drain(timeout_s)
        dist.barrier(group=self._group)
        if self.committer is not None:
            drained = self.committer.catch_up(timeout_s) and drained
        return drained

    def forget_incomplete(self) -> None:
        """A failure: versions not whole by now never will be (rank 0 keeps the tracker)."""
        if self.committer is not None:
            lost = self.committer.forget_incomplete()
            if lost:
                logger.info("%d incomplete version(s) abandoned at the failure", lost)

    def restart(self, *, resume_after: int, persisted_steps: dict[str, int]) -> None:
        """Rebase the policy replica for a resumption at ``resume_after + 1``."""
        self._gathers.clear()
        self.service.restart(world_size=self.world_size, resume_after=resume_after, persisted_steps=persisted_steps)

    def close(self, timeout_s: float = 300.0) -> bool:
        """Drain and stop the writer and the committer (collective); False if something was left."""
        self._settle()
        drained = self.drain(timeout_s)
        self.writer.close()
        if self.committer is not None:
            self.committer.close()
        dist.barrier(group=self._group)
        return drained
