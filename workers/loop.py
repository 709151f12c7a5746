"""The training loop of one rank, with LayerCheck's per-step protocol and no Ray in sight.

After each optimizer step ``t`` the rank reports its drift (without waiting), then collects the
decision for step ``t - 1`` — by now every rank has reported that step, so it is ready — and
snapshots the layers it names: the versions are the layers' state after step ``t`` (a lag of
one step, which the staleness bound accounts for). The last step's decision is carried out
when the loop ends, and with ``save_final`` every other layer is snapshotted at the last step
too, so the store holds the trained model (what ``export`` of a finished run writes). A
coordinator may ask the loop to stop early (:meth:`StepProtocol.stop_requested`: Ctrl-C on the
driver, a storage failure the run's config says to stop for); every rank sees the request on
the same decision, so all stop after the same step. Everything that talks to other processes goes through a
:class:`~layercheck.workers.coordinator.Coordinator`, so the loop runs under Ray, under plain
torch.distributed, or in a test.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from layercheck.workers import optim_state
from layercheck.workers.capture import DEVICE_WAIT_S, StepMark, capture_shards, mark, refusal, state_step
from layercheck.workers.collective_abort import CollectiveAbort
from layercheck.workers.coordinator import (
    BoundedHandover,
    CapturesOnFailure,
    Coordinator,
    KeepsHostBuffers,
    KeepsMemoryVersions,
    SendsInBackground,
    StopsOnRequest,
)
from layercheck.workers.data.dataset import TrainData
from layercheck.workers.data.order import first_index, step_seed
from layercheck.workers.drift.probe import LayerDrift
from layercheck.workers.engine import TrainEngine
from layercheck.workers.host_buffers import HostBufferPool
from layercheck.workers.layout import StateLayout
from layercheck.workers.lr_schedule import lr_at
from layercheck.workers.progress import StepProgress
from layercheck.workers.shard import LayerShard
from layercheck.workers.snapshot_copy import Handover, copier_for, settle
from layercheck.workers.step import train_step

logger = logging.getLogger(__name__)

#: A decision for step t is carried out after step t + DECISION_LAG (this loop collects it then,
#: so the policy never sits on the critical path): the persisted version of a layer is its state
#: after that step, so staleness can exceed the policy's by this much.
DECISION_LAG = 1
#: How long a failed step waits for the rank's queued calls to leave (``SendsInBackground``).
SEND_WAIT_S = 10.0


@dataclass
class LoopResult:
    losses: dict[int, float] = field(default_factory=dict)
    persisted: dict[int, tuple[str, ...]] = field(default_factory=dict)
    """Per step at which snapshots were taken, the layers."""
    held: dict[int, tuple[str, ...]] = field(default_factory=dict)
    """Per step at which a memory version was taken, its layers (``KeepsMemoryVersions``)."""
    stall_s: float = 0.0
    coordination_s: float = 0.0
    """Time in the coordinator's report and decision calls: LayerCheck's per-step protocol cost."""


class StepProtocol:
    """LayerCheck's per-step protocol on one rank, apart from how the step itself is trained:
    the built-in :func:`run_loop` and a user's own loop (``layercheck.attach``) both call
    :meth:`after_step` once after each optimizer step and :meth:`finish` once at the end."""

    def __init__(
        self, layout: StateLayout, coordinator: Coordinator, *, rank: int, abort: CollectiveAbort | None = None
    ) -> None:
        """``abort``: how this rank is released from a collective blocked on a lost peer
        (:mod:`layercheck.workers.collective_abort`), armed while the protocol runs; ``None``: never released."""
        self.layout = layout
        self.coordinator = coordinator
        self.rank = rank
        self.result = LoopResult()
        self._buffers = HostBufferPool()
        give_away = isinstance(coordinator, KeepsHostBuffers) and coordinator.keep_host_buffers(
            self._buffers.recycle, pinned=self._buffers.pin
        )
        self._handover = Handover(copier_for(layout), self._hand_over, self._buffers, give_away=give_away)
        self._keeps_memory = isinstance(coordinator, KeepsMemoryVersions)
        self.memory_period = coordinator.memory_period if isinstance(coordinator, KeepsMemoryVersions) else 0
        """Steps between memory versions: the coordinator's to start with, then the period the
        decisions carry (``persistence.memory_period = "auto"``: the run's choice), the same on
        every rank from the same step on."""
        self._memory_s = 0.0  # memory versions' copies and hand-overs since the last progress report
        # (asked every step: a runtime protocol's isinstance costs tens of µs, so it is checked once)
        self._stops = coordinator if isinstance(coordinator, StopsOnRequest) else None
        self._pending: Any = None
        self._last_step: int | None = None
        self._mark: StepMark | None = None
        self._captured = False
        self.abort = abort
        if abort is not None:
            abort.arm()

    def _hand_over(self, shards: Sequence[LayerShard], *, base: bool, memory: bool = False) -> None:
        if memory:
            assert isinstance(self.coordinator, KeepsMemoryVersions)  # memory versions are taken only then
            started = time.monotonic()
            self.coordinator.hold(shards)
            # (a GPU's copy is handed over at a later step's flush: its cost is counted there)
            self._memory_s += time.monotonic() - started
        else:
            self.coordinator.persist(shards, base=base)

    def hand_over_initial(self) -> None:
        """Before the first step of a run that starts from scratch: hand over every layer's state
        as it is now (the weights the user's loop built, zero moments) as its version at step 0,
        so a failure before a layer's first save still finds a version of it. Written off the
        critical path like any snapshot; a run that rebuilds this state the same way on every
        start records it instead (``layercheck train``: no bytes)."""
        layout = self.layout
        for name in layout.layer_map.names:
            for master in layout[name].masters:
                optim_state.init_state(layout.optimizer, master)  # what Adam's first step would create
        self._handover.take(list(layout.layer_map.names), 0, base=True)
        logger.info("rank %d: the initial state of %d layer(s) handed over", self.rank, len(layout.layer_map.names))

    def after_step(self, step: int, drift: LayerDrift, *, loss: float, lr: float, compute_s: float) -> float:
        """Report step ``step``'s drift (not waiting), carry out step ``step - 1``'s decision,
        and (rank 0) report progress; returns the seconds snapshots held training up."""
        result = self.result
        coordination_before = result.coordination_s
        started = time.monotonic()
        # snapshots of earlier steps whose copies have landed (on a GPU's side stream): handing them
        # over (the coordinator's copy out of the buffers) is this step's stall
        self._handover.flush(wait=False)
        reported = time.monotonic()
        stall_s = reported - started
        handle = self.coordinator.report(drift, lr)
        result.coordination_s += time.monotonic() - reported
        if self._pending is not None:
            stall_s += self._carry_out(self._pending, step)
        if self.memory_period and step % self.memory_period == 0:
            stall_s += self._hold_memory_version(step)
        self._pending, self._last_step = handle, step
        self._mark = mark(self.layout, step)
        result.losses[step] = loss
        result.stall_s += stall_s
        if self.rank == 0:
            self.coordinator.progress(
                StepProgress(
                    step=step,
                    loss=loss,
                    lr=lr,
                    compute_s=compute_s,
                    stall_s=stall_s,
                    coordination_s=result.coordination_s - coordination_before,
                    probe=drift.cost,
                    handed_over=result.persisted.get(step, ()),
                    memory_s=self._memory_s,
                )
            )
        self._memory_s = 0.0
        return stall_s

    def on_failure(self, error: BaseException) -> None:
        """The training step raised (a peer died under a collective, say): hand over this rank's
        capture of every layer before the error ends the rank (best effort, once; see
        :mod:`layercheck.workers.capture`). Nothing is captured before the first completed step of this
        worker group (the state is then the composite just loaded, nothing fresher)."""
        released = self.abort.raised() if self.abort is not None else False
        coordinator = self.coordinator
        if isinstance(coordinator, SendsInBackground) and not coordinator.wait_sent(SEND_WAIT_S):
            logger.error("rank %d: reports queued before the failure had not left after %gs", self.rank, SEND_WAIT_S)
        handover = coordinator.capture if isinstance(coordinator, CapturesOnFailure) else None
        if self._captured or handover is None or self._mark is None:
            return
        self._captured = True
        try:
            if not settle(self.layout, DEVICE_WAIT_S):  # what was queued behind an aborted collective runs first
                logger.error("rank %d: the GPU did not settle within %gs: nothing captured", self.rank, DEVICE_WAIT_S)
                return
            self._handover.flush(wait=True)  # scheduled snapshots already copied go first
            step = state_step(self.layout, self._mark)
            refused = refusal(self._mark, step, synchronous_errors=self.abort is None or self.abort.synchronous_errors)
            if refused:
                logger.error("rank %d: no capture (%s)", self.rank, refused)
                return
            shards = capture_shards(self.layout, step, self._buffers, copier=self._handover.copier)
            logger.info(
                "rank %d: captured at step %d%s", self.rank, step, " (released by an abort)" if released else ""
            )
            handover(shards, step=step, error=error)
        except Exception:  # best effort: the error that ended the step is the one to raise
            logger.exception("rank %d: capture after %r failed", self.rank, error)

    def stop_requested(self) -> bool:
        """The run asked every rank to stop after this step (same answer on every rank)."""
        return self._stops is not None and bool(self._stops.stop_requested())

    def finish(self, *, save_final: bool = False) -> LoopResult:
        """Carry out the last step's decision (its snapshots are the state after that step); with
        ``save_final``, snapshot every layer it did not name at that step as well."""
        step = self._last_step
        if isinstance(self.coordinator, BoundedHandover):
            self.coordinator.steps_ended()
        if self._pending is not None and step is not None:
            self.result.stall_s += self._carry_out(self._pending, step)
            self._pending = None
        if save_final and step is not None:
            done = set(self.result.persisted.get(step, ()))
            rest = tuple(name for name in self.layout.layer_map.names if name not in done)
            if rest:
                self.result.stall_s += self._snapshot(rest, step, base=False)
                self.result.persisted[step] = tuple(done) + rest
                logger.info("step %d: final state of %d layer(s) handed over", step, len(rest))
        if self.abort is not None:
            self.abort.disarm()  # a normal end: nothing to release any more
        started = time.monotonic()
        self._handover.flush(wait=True)
        self._handover.copier.close()
        self.result.stall_s += time.monotonic() - started
        return self.result

    def _carry_out(self, handle: Any, step: int) -> float:
        """Snapshot and hand over what the decision behind ``handle`` names; the time it took."""
        asked = time.monotonic()
        decision = self.coordinator.decision(handle)
        self.result.coordination_s += time.monotonic() - asked
        if decision is not None and decision.memory_period is not None and self._keeps_memory:
            self._follow_period(decision.memory_period, step)
        if not decision:
            return 0.0
        elapsed = self._snapshot(decision.names, step, base=decision.is_base)
        self.result.persisted[step] = decision.names
        logger.debug("step %d: persisted %s (decided at step %d)", step, decision.names, decision.step)
        return elapsed

    def _follow_period(self, period: int, step: int) -> None:
        """The run's memory-version period, as a decision carried it (every rank carries the same
        decision out at the same step, so all switch together)."""
        if period != self.memory_period:
            logger.info(
                "rank %d: memory versions every %d step(s) from step %d on (was %d; persistence.memory_period)",
                self.rank,
                period,
                step,
                self.memory_period,
            )
            self.memory_period = period

    def _hold_memory_version(self, step: int) -> float:
        """Every layer this step's decision did not persist, as a memory version at ``step``."""
        done = set(self.result.persisted.get(step, ()))
        rest = tuple(name for name in self.layout.layer_map.names if name not in done)
        if not rest:
            return 0.0
        counted, started = self._memory_s, time.monotonic()
        self._handover.take(rest, step, base=False, memory=True)
        self.result.held[step] = rest
        elapsed = time.monotonic() - started
        self._memory_s = counted + elapsed  # the whole take: the copy, and its hand-over (not counted twice)
        return elapsed

    def _snapshot(self, names: Sequence[str], step: int, *, base: bool) -> float:
        """Take the snapshot; it is handed over at once where the copy is synchronous (CPU), else
        once its copy has landed (see :mod:`layercheck.workers.snapshot_copy`)."""
        started = time.monotonic()
        self._handover.take(names, step, base=base)
        return time.monotonic() - started


def run_loop(
    train_engine: TrainEngine,
    dataset: TrainData,
    coordinator: Coordinator,
    *,
    start_step: int,
    end_step: int,
    rank: int,
    world_size: int,
    after_step: Callable[[int], None] = lambda step: None,
    save_final: bool = False,
    report_step: Callable[[int, float], None] | None = None,
    abort: CollectiveAbort | None = None,
) -> LoopResult:
    """Train steps ``start_step..end_step`` (inclusive, counted from 1), fewer if the run asks
    to stop; ``save_final``: the last step's state of every layer is handed over at the end.
    ``report_step(step, loss)`` runs after each step, before ``after_step`` (progress reporting).
    ``abort``: see :class:`StepProtocol`."""
    protocol = StepProtocol(train_engine.layout, coordinator, rank=rank, abort=abort)
    try:
        _train(train_engine, dataset, protocol, start_step, end_step, rank, world_size, after_step, report_step)
    except Exception as error:
        protocol.on_failure(error)
        raise
    return protocol.finish(save_final=save_final)


def _train(
    train_engine: TrainEngine,
    dataset: TrainData,
    protocol: StepProtocol,
    start_step: int,
    end_step: int,
    rank: int,
    world_size: int,
    after_step: Callable[[int], None],
    report_step: Callable[[int, float], None] | None,
) -> None:
    engine_cfg = train_engine.engine_cfg
    for step in range(start_step, end_step + 1):
        started = time.monotonic()
        batches = [
            dataset.micro_batch(
                step=step,
                micro=m,
                rank=rank,
                world_size=world_size,
                micro_batch=engine_cfg.micro_batch,
                grad_accum=engine_cfg.grad_accum,
            )
            for m in range(engine_cfg.grad_accum)
        ]
        first = first_index(
            step=step,
            micro=0,
            rank=rank,
            world_size=world_size,
            micro_batch=engine_cfg.micro_batch,
            grad_accum=engine_cfg.grad_accum,
        )
        torch.manual_seed(step_seed(train_engine.model_cfg.seed, first))  # dropout as the failure-free run's
        loss, drift = train_step(train_engine, batches)
        protocol.after_step(
            step, drift, loss=loss, lr=lr_at(step - 1, train_engine.optim_cfg), compute_s=time.monotonic() - started
        )
        if report_step is not None:
            report_step(step, loss)
        after_step(step)
        if protocol.stop_requested():
            logger.warning("rank %d: stopping after step %d, as the run asked", rank, step)
            break
