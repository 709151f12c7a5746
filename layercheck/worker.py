"""Worker side: attach LayerCheck to the engine of your own training loop.

Inside a :class:`layercheck.LayerCheckTrainer`'s ``train_loop_per_worker``, with DeepSpeed::

    engine, *_ = deepspeed.initialize(model=model, config=ds_config, ...)
    lc = layercheck.attach(engine)            # a restarted worker group: loads the composite first
    for step in range(lc.start_step, total_steps + 1):
        loss = my_loss(engine, batch_at(step)); engine.backward(loss); engine.step()
        lc.after_step(step, loss=loss)        # drift report, the decision, snapshots
    lc.finish()

or with FSDP2 (``fully_shard`` on each decoder layer, then the root, over a 1-D mesh)::

    lc = layercheck.attach(model, optimizer, lr_scheduler=scheduler)
    for step in range(lc.start_step, total_steps + 1):
        loss = my_loss(model, batch_at(step)); loss.backward(); optimizer.step(); scheduler.step()
        optimizer.zero_grad()
        lc.after_step(step, loss=loss)
    lc.finish()

Steps count from 1: ``after_step(t)`` follows the ``t``-th optimizer step. The per-step protocol
is :class:`layercheck.workers.loop.StepProtocol`, the one ``layercheck train`` runs.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping
from types import TracebackType
from typing import TYPE_CHECKING

import ray
import torch

from layercheck.orchestrator.runtime import context
from layercheck.orchestrator.runtime.names import NAMESPACE, RunNames
from layercheck.orchestrator.runtime.ray_coordinator import RayCoordinator
from layercheck.orchestrator.runtime.resume_ref import resume_of
from layercheck.orchestrator.runtime.train_fn import fault_hook, recover
from layercheck.orchestrator.store.fs import StoreFS
from layercheck.orchestrator.store.model_identity import recorded_model_changes
from layercheck.orchestrator.store.model_record import MODEL_FILE
from layercheck.orchestrator.store.uri import redact_uri
from layercheck.policies.configs import schedule_warnings
from layercheck.policies.layer_map import LayerMap, LayerMapSpec
from layercheck.workers import collective_abort
from layercheck.workers.attached import AttachedEngine, attach_engine
from layercheck.workers.loop import LoopResult, StepProtocol

if TYPE_CHECKING:
    from torch.optim.lr_scheduler import LRScheduler

    from layercheck.policies.configs import PolicyConfig
    from layercheck.workers.engines.deepspeed import DeepSpeedEngine

logger = logging.getLogger(__name__)


class LayerMismatchError(ValueError):
    """The workers' model is not the one the driver planned the run with (its layers, or the config
    fields the run's ``model.json`` records)."""


class Attachment:
    """LayerCheck attached to one rank's engine; made by :func:`attach`."""

    def __init__(
        self,
        attached: AttachedEngine,
        protocol: StepProtocol,
        *,
        start_step: int,
        attempt: int,
        kill: Callable[[int], None],
        save_final: bool = True,
        policy: PolicyConfig | None = None,
        drain_s: float = 120.0,
    ) -> None:
        self._attached = attached
        self._drain_s = drain_s
        self._policy = policy
        self._save_final = save_final
        self._protocol = protocol
        self._kill = kill
        self._next_step = start_step
        self._lr = attached.adapter.current_lr()
        self._since = time.monotonic()
        self._finished = False
        self.start_step = start_step
        """The first step to train: 1 on a fresh start, ``t_fail + 1`` after a recovery."""
        self.attempt = attempt
        """1 for the first worker group, then one more per restart."""

    @property
    def layer_map(self) -> LayerMap:
        """The layers LayerCheck tracks, in model order."""
        return self._attached.layer_map

    @property
    def result(self) -> LoopResult:
        """This rank's losses, persisted layers per step, and protocol timings so far."""
        return self._protocol.result

    def after_step(self, step: int, *, loss: float | torch.Tensor) -> None:
        """Call once after optimizer step ``step`` (``start_step``, then one more each time):
        reports this rank's drift, carries out the previous step's decision (snapshots of the
        layers it names) and, on rank 0, reports ``loss`` as the run's progress."""
        if step != self._next_step:
            raise ValueError(
                f"after_step({step}): expected step {self._next_step} (call it once after each "
                "optimizer step, counting from lc.start_step)"
            )
        engine_step = self._attached.adapter.steps_taken()
        if engine_step != step:
            raise ValueError(
                f"after_step({step}) but the engine has taken {engine_step} optimizer steps: call it "
                "after the optimizer step (DeepSpeed: engine.step() at a gradient-accumulation boundary; "
                "FSDP2: optimizer.step()), once per optimizer step"
            )
        compute_s = time.monotonic() - self._since
        drift = self._attached.probe.collect(step)
        value = float(loss.detach().float()) if isinstance(loss, torch.Tensor) else float(loss)
        self._protocol.after_step(step, drift, loss=value, lr=self._lr, compute_s=compute_s)
        self._kill(step)
        self._next_step = step + 1
        self._lr = self._attached.adapter.current_lr()  # the rate the next step will use
        self._since = time.monotonic()

    def check_steps(self, total_steps: int) -> list[str]:
        """Warn (rank 0 logs them; all ranks return them) where the run's schedule is too long
        for a loop of ``total_steps`` steps: a warm-up or period the run never reaches leaves its
        layers at their step-0 version until the final save. The Trainer callback calls it."""
        if self._policy is None or total_steps <= 0:
            return []
        found = schedule_warnings(self._policy, total_steps, prefix=f"{type(self._policy).__name__}.")
        if self._protocol.rank == 0:
            for warning in found:
                logger.warning("LayerCheck: %s", warning)
        return found

    @property
    def stop_requested(self) -> bool:
        """The run asks every rank to stop (Ctrl-C on the driver, storage that broke the staleness
        bound): every rank sees it after the same step; leave the loop and call :meth:`finish`."""
        return self._protocol.stop_requested()

    def finish(self) -> LoopResult:
        """Carry out the last step's decision, persist every layer's state at the last step (unless
        ``persistence.save_final`` is off), and wait until this rank's snapshots are handed to the
        writers. Call once, after the last step."""
        if not self._finished:
            self._finished = True
            self._protocol.finish(save_final=self._save_final)
            coordinator = self._protocol.coordinator
            if isinstance(coordinator, RayCoordinator):
                coordinator.flush(timeout_s=self._drain_s)  # (persistence.stop_drain_s)
        return self._protocol.result

    def __enter__(self) -> Attachment:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is None:
            self.finish()


def attach(
    engine: DeepSpeedEngine | torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    lr_scheduler: LRScheduler | None = None,
    layer_map: LayerMapSpec | None = None,
    drift_probe: str | None = None,
) -> Attachment:
    """Attach LayerCheck to your loop's engine inside a :class:`layercheck.LayerCheckTrainer` run:

    - DeepSpeed: ``attach(engine)``, what ``deepspeed.initialize`` returned (any ZeRO stage, your own
      DeepSpeed config, an Adam-family optimizer with any param groups);
    - FSDP2: ``attach(model, optimizer, lr_scheduler=scheduler)``, a model sharded with
      ``fully_shard`` (each decoder layer, then the root) over a 1-D mesh of all ranks, torch's
      ``Adam``/``AdamW`` (foreach or fused, any param groups), the scheduler optional (one you
      step once per optimizer step; LayerCheck moves it on a recovery).

    Every rank calls it, after the engine is built and before the first step. On a restarted worker
    group it first loads the composite and moves the engine (its step count and scheduler) to
    ``start_step - 1``.

    ``layer_map`` / ``drift_probe`` override the trainer's :class:`layercheck.CheckpointConfig`.
    Raises before training: ``UnplacedParameterError`` (parameters no layer holds: pass a
    ``layer_map``), ``UnsupportedOptimizerError`` (not an Adam-family optimizer),
    ``UnsupportedShardingError`` (FSDP1, a model not sharded with ``fully_shard``, a placement other
    than ``Shard(0)`` on a 1-D mesh),
    :class:`LayerMismatchError` (not the model the trainer was given: other layer sizes, or other
    config fields than the run's ``model.json`` records, e.g. the attention heads).
    """
    ctx = context.current()
    if ctx is None:
        raise RuntimeError(
            "layercheck.attach() runs inside the train_loop_per_worker of a "
            "layercheck.LayerCheckTrainer (it finds the run's actors through it)"
        )
    attached = attach_engine(
        engine,
        optimizer,
        lr_scheduler=lr_scheduler,
        layer_map=layer_map if layer_map is not None else ctx.layer_map,
        drift_probe=drift_probe or ctx.drift_probe,
        drift_every=ctx.policy.drift_every if ctx.policy is not None else 1,
    )
    _check_layers(attached.layer_map, ctx.layer_numel)
    _check_in_place(attached, ctx.in_place)
    _check_recorded_model(attached.adapter.module, ctx.storage_uri)
    rank, world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
    names = RunNames(ctx.run_id)
    supervisor = ray.get_actor(names.supervisor, namespace=NAMESPACE)
    policy = ray.get_actor(names.policy, namespace=NAMESPACE)
    runtime = ray.get_runtime_context()
    incarnation = context.incarnation()
    worker_id = incarnation.worker_id(runtime.get_actor_id() or f"pid{os.getpid()}")
    resume = resume_of(ray.get(supervisor.join.remote(rank, world_size, worker_id, attached.adapter.kind)))
    writers = ray.get(supervisor.writers_for.remote(runtime.get_node_id()))
    start = incarnation.rank_start(rank, time.time())  # the loop's own work so far (a promoted spare's: since then)
    if resume.records is not None:
        recover(
            attached,
            ctx.storage_uri,
            ctx.fsync,
            resume.records,
            supervisor,
            rank,
            overlays=resume.overlays,
            start=start,
        )
        attached.adapter.seek(resume.start_step - 1)
        attached.probe.reset(resume.start_step)  # it measures the steps a run without the failure would
        logger.warning("rank %d: recovered; training resumes at step %d", rank, resume.start_step)
    elif resume.attempt > 1:  # a restart with nothing to load: its start and build are still the recovery's
        supervisor.loaded.remote(rank, 0.0, {}, start)
    coordinator = RayCoordinator(
        rank=rank,
        policy=policy,
        writer=writers[rank % len(writers)],
        supervisor=supervisor,
        max_inflight_bytes=ctx.max_inflight_bytes,
        attempt=resume.attempt,
        capture_timeout_s=ctx.capture_timeout_s,
        memory_period=ctx.memory_period,
        decision_timeout_s=ctx.decision_timeout_s,
    )
    # Ray Train's controller releases this rank from a collective blocked on a lost peer (NCCL), so it
    # captures; in place it must be released to recover at all (ReplaceInPlace)
    released = ctx.capture_timeout_s is not None or ctx.in_place
    abort = collective_abort.install(collective_abort.for_current_group()) if released else None
    protocol = StepProtocol(attached.layout, coordinator, rank=rank, abort=abort)
    context.on_failure(protocol.on_failure)  # the loop raised (a peer died): hand over what this rank holds
    if ctx.in_place:  # then release the engine: this process builds the next one (LayerCheckTrainer's in_place)
        context.on_failure(lambda error: _release(attached))
    incarnation.attached = True
    if resume.records is None:  # from scratch: LayerCheck cannot rebuild what this loop built, so it keeps it
        protocol.hand_over_initial()
    return Attachment(
        attached,
        protocol,
        start_step=resume.start_step,
        attempt=resume.attempt,
        kill=fault_hook(ctx.fault, rank, resume.attempt, coordinator),
        save_final=ctx.save_final,
        policy=ctx.policy,
        drain_s=ctx.stop_drain_s,
    )


def _check_in_place(attached: AttachedEngine, in_place: bool) -> None:
    """In place, a survivor must learn of the loss from its own collective. With gloo that happens
    only in a collective with the lost rank: under HSDP a survivor can wait in its replicate or shard
    group on a live peer that already left (torch's gloo closes a group's connections only when the
    process ends; an abort does not), and would hang. NCCL's survivors are aborted instead."""
    if in_place and attached.layout.subgroups and torch.distributed.get_backend() == "gloo":
        raise ValueError(
            "in-place recovery (CheckpointConfig(in_place=True)) of an HSDP model on gloo: a survivor waiting "
            "in its replicate or shard group on a live peer would never be released; run HSDP in place on "
            "NCCL (GPUs), or without in_place (a full restart recovers it)"
        )


def _release(attached: AttachedEngine) -> None:
    """Best effort: the engine of a loop that raised, before its process leaves the group."""
    try:
        attached.adapter.release()
    except Exception as error:  # noqa: BLE001 - the group is broken: what is left goes with it
        logger.info("destroying the engine after the loop raised: %r", error)


def _check_recorded_model(model: torch.nn.Module, storage_uri: str) -> None:
    """The engine's model against the run's ``model.json`` (the driver's ``model=``), config field by
    field: heads of another size can give every layer the same parameter count, and the composite
    would load into a model other than the one the store records (and exports). Before this rank
    joins the run, so a refused attach writes nothing."""
    changes = recorded_model_changes(StoreFS.open(storage_uri), model)
    if changes:
        raise LayerMismatchError(
            f"the engine's model is not the one the run in {redact_uri(storage_uri)} records in {MODEL_FILE} "
            f"({', '.join(changes)}): give LayerCheckTrainer(model=...) the model this loop trains, "
            "or build this loop's model from the recorded config"
        )


def _check_layers(layers: LayerMap, planned: Mapping[str, int]) -> None:
    if dict(layers.numel) != dict(planned):
        raise LayerMismatchError(
            f"the engine's model has layers {layers.numel}, but the trainer planned the run for "
            f"{dict(planned)}: give LayerCheckTrainer(model=...) the model this loop trains "
            "(and the same layer_map)"
        )
