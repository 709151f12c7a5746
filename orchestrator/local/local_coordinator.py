"""The :class:`layercheck.workers.coordinator.Coordinator` of a run under plain torch.distributed, no Ray.
One file because it is one class, a rank's whole side of the protocol: each part below lives in a
module of its own (``exchange.py``, ``writer.py``, ``writers_port.py``, ``receipts.py``,
``mailbox.py``); what stays here is how one rank wires them together and joins its group.

It runs the Ray runtime's protocol with the same cores, spread over the ranks instead of actors:

* **decisions**: every rank keeps a replica of the :class:`PolicyService`, fed by a
  :class:`~layercheck.orchestrator.local.exchange.DecisionExchange` of every rank's drift report
  (an asynchronous all_gather on a gloo side group; settlements and the write budget ride on it):
  the policy is pure, so every replica decides the same. See :mod:`layercheck.orchestrator.local.exchange`.
* **writes**: each rank's :class:`LocalWriter` thread drains a superseding queue into
  ``LayerStore.write_shard`` under the in-flight byte bound (``PersistenceConfig.max_inflight_bytes``).
* **supervision**: rank 0 hosts the run's :class:`RunSupervisor` — the one the Ray ``SupervisorActor``
  wraps — with :class:`LocalPolicy` over its policy replica and :class:`LocalWriters` over
  every rank's writer. Receipts reach it through the :class:`Mailbox` (:class:`ReceiptPump`), so
  commits get :class:`CommitPath`'s retries and lost-version accounting; a new worker group
  (:meth:`rejoin`, after a failure) joins it under new worker ids, so :class:`RecoveryMachine` decides
  the recovery (drain, plan at ``t_fail``, rebase) exactly as under Ray; :meth:`status` is its
  :class:`RunView`.
* **survivor capture** (``capture=True``, as the run config's ``persistence.capture``): when a
  step raises under a rank, :meth:`layercheck.workers.loop.StepProtocol.on_failure` hands the rank's slices
  of every layer at its last step to :meth:`capture`, which queues them on the rank's writer
  ahead of everything else as ``origin="capture"`` shards; the recovery commits the lost group's
  incomplete versions up to ``t_fail`` as partial versions and overlays them on the composite.
* **memory tier** (``memory_bytes > 0``, as the run config's ``persistence.memory_bytes``): each
  rank's writer keeps the newest shard files it wrote in memory, and the recovery opens the
  composite's files from there before storage (:mod:`layercheck.orchestrator.local.memory`).

Recovery after a failure: :func:`layercheck.orchestrator.local.recovery.recover`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from layercheck.orchestrator.core.memory.auto_period import MemoryPeriodSetting, PeriodTimer, starting_period
from layercheck.orchestrator.core.memory.budget import memory_version_need, warn_if_unkept
from layercheck.orchestrator.core.persistence.write_budget import DrainBudget, WriteBudgetConfig
from layercheck.orchestrator.core.policy_service import PolicyService
from layercheck.orchestrator.core.recovery.config import SupervisionConfig
from layercheck.orchestrator.core.recovery.events import ResumeInfo
from layercheck.orchestrator.core.run_supervisor import RunSupervisor
from layercheck.orchestrator.local.exchange import DecisionExchange, RankNews, SettledAtNextReport
from layercheck.orchestrator.local.mailbox import Mailbox
from layercheck.orchestrator.local.receipts import ReceiptPump
from layercheck.orchestrator.local.writer import LocalWriter
from layercheck.orchestrator.local.writers_port import LocalWriters, drain_mine, writer_name
from layercheck.orchestrator.store.layer_store import LayerStore
from layercheck.orchestrator.store.manifest import MEMORY_ORIGIN
from layercheck.policies.checkpoint_policy import CheckpointPolicy
from layercheck.policies.decision import PersistDecision
from layercheck.workers.drift.probe import LayerDrift
from layercheck.workers.progress import StepProgress
from layercheck.workers.shard import LayerShard

if TYPE_CHECKING:
    from layercheck.workers.coordinator import (
        BoundedHandover,
        CapturesOnFailure,
        Coordinator,
        KeepsHostBuffers,
        KeepsMemoryVersions,
    )

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class GroupAnswer:
    """What rank 0 tells every rank of a group that (re)joined the run's supervisor."""

    resume: ResumeInfo
    replaced: tuple[str, ...] = ()
    """Writers the recovery's drain wrote off: the ranks owning them start new ones."""
    t_fail: int = 0
    drain_s: float = 0.0
    plan_s: float = 0.0
    """Planning the composite, after the drain."""
    weighted_staleness: float = 0.0
    max_staleness: int = 0


class LocalCoordinator:
    """One rank's coordinator; every rank of the group constructs one (collectively)."""

    def __init__(
        self,
        *,
        policy: CheckpointPolicy,
        layer_numel: Mapping[str, int],
        store: LayerStore,
        max_inflight_bytes: int,
        max_versions_in_flight: int = 2,
        drift_every: int = 1,
        config: SupervisionConfig | None = None,
        run_id: str = "local",
        write_budget: WriteBudgetConfig | None = None,
        capture: bool = False,
        memory_bytes: int = 0,
        memory_period: MemoryPeriodSetting = 0,
    ) -> None:
        """``memory_period``: as ``persistence.memory_period``; ``"auto"``: rank 0's supervisor
        chooses it from its first steps' timings and every replica's decisions carry it
        (``core/memory/auto_period.py``)."""
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.layer_numel = dict(layer_numel)
        self.layers = tuple(self.layer_numel)
        self.config = config or SupervisionConfig()
        # each rank's writer holds that rank's files alone (no mirror: the ranks share one machine)
        need = memory_version_need(self.layer_numel, world_size=self.world_size, ranks=1)
        start = starting_period(memory_period, need=need, memory_bytes=memory_bytes)
        self.service = PolicyService(
            policy,
            self.layers,
            self.world_size,
            max_versions_in_flight=max_versions_in_flight,
            drift_every=drift_every,
            memory_period=start.period if start.auto else None,
        )
        self.store = store
        self._group = dist.new_group(backend="gloo")  # small CPU tensors, off the training stream
        self.mailbox = Mailbox.create()
        self.max_inflight_bytes = max_inflight_bytes
        self.memory_bytes = memory_bytes
        self.memory_period = 0 if start.auto else start.period
        """Steps between memory versions until a decision carries the run's (``"auto"``: 0, then the
        decisions carry it from the second step of the group on)."""
        self._memory_timer = PeriodTimer(start, need=need, memory_bytes=memory_bytes)
        if self.rank == 0:
            logger.info("memory versions: %s", start.why)
        self.memory_promise = (
            warn_if_unkept(
                self.layer_numel,
                memory_period=start.period if not start.auto else 0,
                memory_bytes=memory_bytes,
                world_size=self.world_size,
                ranks=1,
            )
            if self.rank == 0
            else ""
        )
        """Why ``memory_period`` cannot be kept with ``memory_bytes`` (rank 0, said at the start; "": it can)."""
        self._recycle: Callable[[LayerShard], None] | None = None
        """Set where the loop gives the snapshots' buffers away (:meth:`keep_host_buffers`): no copy
        of them here, and the writers hand each shard back through it once done with it."""
        self.writer = self._new_writer()
        self.exchange = DecisionExchange(
            self.service,
            self.layers,
            self.world_size,
            self._group,
            budget=DrainBudget(write_budget) if write_budget is not None and write_budget.enabled else None,
        )
        self._last_step_s = 0.0
        self._rounds = 0  # collective drains so far (every rank counts alike)
        self._generation = 0  # worker groups so far: a new one after each failure
        self.handed: list[tuple[int, tuple[str, ...]]] = []
        """(step, layers) of every snapshot handed to the writer, in order."""
        self.progress_log: list[StepProgress] = []
        self.captures: list[tuple[int, tuple[str, ...], int]] = []
        """(step, layers, bytes) of every survivor's capture this rank handed to its writer."""
        self.capture = self._capture if capture else None
        """``StepProtocol.on_failure`` hands a survivor's capture to this (``None``: capture is off)."""
        self.run: RunSupervisor | None = None
        """Rank 0: the run's supervisor; ``None`` on the other ranks."""
        self._pump: ReceiptPump | None = None
        self._settlements: SettledAtNextReport | None = None
        self._port: LocalWriters | None = None
        if self.rank == 0:
            self._pump, self._port, self.run = self._host(run_id)
            self._join_all()  # attempt 1: a fresh start at step 1
        else:  # what the fresh start's RebasePolicy does to rank 0's replica
            self.service.restart(world_size=self.world_size, resume_after=0, persisted_steps={})

    def _host(self, run_id: str) -> tuple[ReceiptPump, LocalWriters, RunSupervisor]:
        port = LocalWriters(
            own=lambda: self.writer,
            mailbox=self.mailbox,
            world_size=self.world_size,
            catch_up=lambda timeout_s: pump.catch_up(timeout_s),
        )
        self._settlements = SettledAtNextReport(self.service)
        run = RunSupervisor(
            run_id=run_id,
            store=self.store,
            layer_numel=self.layer_numel,
            policy=self._settlements,
            writers=port,
            config=self.config,
            memory_period=self._memory_timer,
        )
        pump = ReceiptPump(self.mailbox, run)
        return pump, port, run

    # ---- layercheck.workers.coordinator.Coordinator ---------------------------------------------------
    def report(self, drift: LayerDrift, lr: float) -> int:
        return self.exchange.report(drift, lr, news=self._news)

    def _news(self) -> RankNews:
        """What this rank's exchanged report carries beside its drift."""
        stats = self.writer.snapshot_stats()
        settled = self._settlements.newest(self.layers) if self._settlements else [-1.0] * len(self.layers)
        period = self._settlements.memory_period() if self._settlements else -1.0
        return RankNews(settled, float(stats.written_bytes), stats.write_s, self._last_step_s, period)

    def decision(self, handle: int) -> PersistDecision | None:
        return self.exchange.decision(handle)

    def persist(self, shards: Sequence[LayerShard], *, base: bool) -> None:
        for shard in shards:
            self.writer.submit(self._owned(shard), base=base)
        if shards:
            self.handed.append((shards[0].step, tuple(s.layer for s in shards)))

    def hold(self, shards: Sequence[LayerShard]) -> None:
        """A memory version's shards to this rank's writer, which holds them in memory only."""
        for shard in shards:
            self.writer.submit(self._owned(shard), base=False, origin=MEMORY_ORIGIN)

    def keep_host_buffers(self, recycle: Callable[[LayerShard], None], *, pinned: bool) -> bool:
        """``KeepsHostBuffers``: where the loop's snapshot buffers are plain host memory, the writer
        keeps them as they are (the writer is a thread of this process) and hands each shard to
        ``recycle`` once written or superseded. Pinned ones are declined: the writer would hold
        them until its write to storage, and the loop would pin new ones meanwhile."""
        if pinned:
            return False
        self._recycle = recycle
        self.writer.recycle = recycle
        return True

    def _owned(self, shard: LayerShard) -> LayerShard:
        """``shard`` for the writer to keep: itself, or a copy where the loop reuses its buffers."""
        if self._recycle is not None:
            return shard
        return replace(shard, tensors={k: v.clone() for k, v in shard.tensors.items()})

    def steps_ended(self) -> None:
        """The last step is done: the final save does not wait for storage (``BoundedHandover``)."""
        self.writer.unbounded = True

    def _capture(self, shards: Sequence[LayerShard], *, step: int, error: BaseException) -> None:
        """A survivor's capture (:mod:`layercheck.workers.capture`): to this rank's writer, ahead of what it
        holds, as ``origin="capture"`` shards. The writer outlives the failure here (as a Ray
        persistence writer outlives its trainer), so no hold is needed: the recovery's drain
        writes them, their receipts reach rank 0's supervisor like any shard's, and it commits
        them as partial versions (overlaid on the whole versions at the recovery)."""
        for shard in shards:
            self.writer.submit(self._owned(shard), base=False, origin="capture")
        nbytes = sum(s.nbytes for s in shards)
        self.captures.append((step, tuple(s.layer for s in shards), nbytes))
        logger.warning(
            "rank %d: step raised (%s); handed the state at step %d of %d layers (%d bytes) to the writer",
            self.rank,
            type(error).__name__,
            step,
            len(shards),
            nbytes,
        )

    def progress(self, progress: StepProgress) -> None:
        self._last_step_s = progress.compute_s + progress.stall_s + progress.coordination_s
        self.progress_log.append(progress)
        if self.run is not None:
            self.run.progress(progress)

    # ---- the rest of the protocol ----------------------------------------------------------
    def last_complete_step(self) -> int:
        """Every rank's report gathered: the last step all ranks completed (``t_fail`` after a
        failure). Collective: every rank calls it at the same point."""
        self.exchange.settle()
        return int(self.all_min([float(self.service.last_complete_step)])[0])  # (quiet steps complete alone)

    def rejoin(self) -> GroupAnswer:
        """A new worker group (this one, after a failure) joins the run's supervisor under new
        worker ids: the recovery drains every rank's writer, rank 0's supervisor plans and
        rebases its replica, and every rank gets the same :class:`GroupAnswer` (collective).
        Raises ``RuntimeError`` on every rank if the recovery itself failed."""
        self._rounds += 1
        self._generation += 1
        answer: GroupAnswer | str | None = None
        if self.run is None:
            drain_mine(
                self.writer, self.mailbox, round_=self._rounds, rank=self.rank, deadline_s=self.config.drain_deadline_s
            )
        else:
            assert self._port is not None
            self._port.begin(self._rounds)
            try:
                answer = self._join_all()
            except Exception as error:  # every rank must hear it, or they wait here forever
                logger.exception("the recovery failed")
                answer = f"{type(error).__name__}: {error}"
        answer = self._broadcast(answer)
        if isinstance(answer, str):
            raise RuntimeError(f"recovery failed on rank 0: {answer}")
        if writer_name(self.rank) in answer.replaced:
            logger.warning("rank %d: replacing a writer that did not answer the drain", self.rank)
            self.writer.abandon()
            self.writer = self._new_writer()  # what the old one held in memory is written off with it
        return answer

    def _new_writer(self) -> LocalWriter:
        writer = LocalWriter(
            self.store, self.mailbox, max_inflight_bytes=self.max_inflight_bytes, memory_bytes=self.memory_bytes
        )
        writer.recycle = self._recycle
        return writer

    def _join_all(self) -> GroupAnswer:
        """Rank 0: every rank of the group joins the supervisor (rank 0's join carries out the recovery)."""
        assert self.run is not None and self._port is not None
        resume = self.run.join(0, self.world_size, self._worker_id(0))
        for rank in range(1, self.world_size):
            self.run.join(rank, self.world_size, self._worker_id(rank))
        recoveries = self.run.status().account["recoveries"]
        if resume.attempt == 1 or not recoveries:
            return GroupAnswer(resume=resume)
        last = recoveries[-1]
        drain_s = self._port.drain_s
        return GroupAnswer(
            resume=resume,
            replaced=tuple(self._port.replaced),
            t_fail=last["t_fail"],
            drain_s=drain_s,
            plan_s=max(0.0, last["plan_s"] - drain_s),
            weighted_staleness=last["weighted_staleness"],
            max_staleness=last["max_staleness"],
        )

    def _worker_id(self, rank: int) -> str:
        return f"rank{rank}-group{self._generation}"

    def resumed(self, answer: GroupAnswer, load_s: float, sources: Mapping[str, float] | None = None) -> None:
        """Every rank loaded the group's composite (``load_s``: the slowest rank's; ``sources``:
        where all ranks' shard files came from, a ``LoadSources`` summed): the replicas restart as
        rank 0's did under the supervisor's ``RebasePolicy``."""
        self.exchange.forget()
        records = answer.resume.records or {}
        if self.run is not None:
            self.run.loaded(load_s, sources)
        else:
            self.service.restart(
                world_size=self.world_size,
                resume_after=answer.resume.start_step - 1,
                persisted_steps={layer: r.step for layer, r in records.items()},
            )

    def version_unusable(self, found: Sequence[tuple[str, str]]) -> None:
        """Ranks found these (version id, why) corrupt while loading: rank 0's supervisor skips them."""
        if self.run is not None:
            for version_id, reason in found:
                self.run.version_unusable(version_id, reason)

    def restart(self, *, resume_after: int, persisted_steps: dict[str, int]) -> None:
        """Rebase the policy replica for a resumption at ``resume_after + 1`` without the
        supervisor (a baseline's own recovery)."""
        self.exchange.forget()
        self.service.restart(world_size=self.world_size, resume_after=resume_after, persisted_steps=persisted_steps)

    def drain(self, timeout_s: float) -> bool:
        """Every rank's writer finishes what it holds and rank 0 commits what is whole (a
        collective); False on every rank if a writer or the commits missed the deadline."""
        self._rounds += 1
        unanswered: tuple[str, ...] | None = None
        if self._port is None:
            drain_mine(self.writer, self.mailbox, round_=self._rounds, rank=self.rank, deadline_s=timeout_s)
        else:
            self._port.begin(self._rounds)
            unanswered = self._port.drain(timeout_s)
        return not self._broadcast(unanswered)

    def status(self) -> dict[str, Any] | None:
        """Rank 0: the run's status (the Ray run's ``SupervisorActor.status``); ``None`` elsewhere."""
        return self.run.status().as_dict() if self.run is not None else None

    def committed(self) -> list[tuple[str, int]]:
        """Rank 0: (layer, step) of every committed version, from the manifest."""
        return [(r.layer, r.step) for r in self.store.versions()]

    def all_max(self, values: Sequence[float]) -> list[float]:
        """Each value's maximum over the ranks (collective, on the side group)."""
        return self._all_reduce(values, dist.ReduceOp.MAX)

    def all_min(self, values: Sequence[float]) -> list[float]:
        """Each value's minimum over the ranks (collective, on the side group)."""
        return self._all_reduce(values, dist.ReduceOp.MIN)

    def all_sum(self, values: Sequence[float]) -> list[float]:
        """Each value's sum over the ranks (collective, on the side group)."""
        return self._all_reduce(values, dist.ReduceOp.SUM)

    def _all_reduce(self, values: Sequence[float], op: Any) -> list[float]:
        tensor = torch.tensor(list(values), dtype=torch.float64)
        dist.all_reduce(tensor, op=op, group=self._group)
        return tensor.tolist()

    def all_gather(self, value: Any) -> list[Any]:
        """Every rank's ``value`` (collective, on the side group)."""
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, value, group=self._group)
        return out

    def _broadcast(self, value: Any) -> Any:
        box = [value]
        dist.broadcast_object_list(box, src=0, group=self._group)
        return box[0]

    def close(self, timeout_s: float = 300.0, *, ok: bool = True) -> bool:
        """Drain and stop the writer (collective); rank 0's supervisor finishes the run. False
        if something was left."""
        self.exchange.settle()
        drained = self.drain(timeout_s)
        self.writer.close()
        if self.run is not None and self._pump is not None:
            self._pump.close()
            self.run.finish(ok, "" if ok else "the trainer raised")
        dist.barrier(group=self._group)
        return drained


if TYPE_CHECKING:  # the type check holds LocalCoordinator to the loop's protocol, its optional capture included
    _LOCAL_COORDINATOR: tuple[
        type[Coordinator],
        type[CapturesOnFailure],
        type[BoundedHandover],
        type[KeepsMemoryVersions],
        type[KeepsHostBuffers],
    ] = (LocalCoordinator, LocalCoordinator, LocalCoordinator, LocalCoordinator, LocalCoordinator)
