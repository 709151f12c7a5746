"""One rank's run of one benchmark strategy, :class:`Runner`, on LayerCheck's own loop; the
benchmark (:mod:`layercheck.bench.harness`) runs every strategy in turn through one per rank.

Every strategy runs the product's protocol: :func:`layercheck.workers.loop.run_loop` with the local
runtime's :class:`LocalCoordinator` (the policy service, the superseding writers under the
in-flight byte bound, rank 0's run supervisor with the Ray runtime's commit and recovery cores). LayerCheck's strategies are their policy; the
baselines run a ``never`` (or ``interval``) policy with their own checkpointing in the loop's
``after_step`` hook (:mod:`layercheck.bench.baselines`).

A failure after step F is a fail-stop of the last rank: the survivors' step raises (with the
``capture`` tier, they hand their slices of every layer to their writers first), then the whole
group's in-memory training state is wiped (every layer NaN, step 0; a layer a recovery misses
shows up as a NaN loss) and the strategy recovers its way — LayerCheck's through the product's
recovery (:func:`layercheck.orchestrator.local.recovery.recover`; with the ``memory`` tier its shard files
come from the writers' memory first), rollbacks by re-running the lost steps
(timed) — and the loop continues at F + 1. Around it, every rank's owned fp32 weights at F are
compared with what the recovery loaded (:mod:`layercheck.bench.unsaved`): the unsaved drift at recovery.
"""

from __future__ import annotations

import logging
import shutil
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from layercheck.bench.baselines import make_baseline
from layercheck.bench.formulas import trace_of
from layercheck.bench.presets import Workload
from layercheck.bench.run_record import (
    commits,
    handed_bytes,
    persisted_steps,
    replay_freshness,
    slowest_timings,
    sum_all,
)
from layercheck.bench.s3_loopback import LoopbackBucket
from layercheck.bench.strategies import Kind, Strategy
from layercheck.bench.unsaved import owned_weights, unsaved_at_recovery
from layercheck.orchestrator.core.persistence.config import PersistenceConfig
from layercheck.orchestrator.local.local_coordinator import LocalCoordinator
from layercheck.orchestrator.local.recovery import recover
from layercheck.orchestrator.local.run import train_with_failures, wipe_training_state
from layercheck.orchestrator.store.layer_store import LayerStore
from layercheck.policies.checkpoint_policy import build_policy
from layercheck.policies.trace import filled

if TYPE_CHECKING:
    from layercheck.workers.drift.probe import DriftReader, LayerDrift
    from layercheck.workers.shard import LayerShard

logger = logging.getLogger(__name__)


class TimedProbe:
    """The engine's drift probe with the time of its ``collect`` (the per-step host read) summed."""

    def __init__(self, inner: DriftReader) -> None:
        self.inner = inner
        self.seconds = 0.0

    @property
    def numel(self) -> Mapping[str, int]:
        return self.inner.numel

    def collect(self, step: int) -> LayerDrift:
        started = time.monotonic()
        try:
            return self.inner.collect(step)
        finally:
            self.seconds += time.monotonic() - started

    def reset(self, next_step: int | None = None) -> None:
        """Drop the drift gathered so far: what a restore asks of the engine's probe."""
        self.inner.reset(next_step)

    def measure_every(self, every: int) -> None:
        self.inner.measure_every(every)


def _configs(w: Workload) -> tuple[Any, Any, Any]:
    from layercheck.workers.config import EngineConfig, ModelConfig, OptimConfig

    return (
        ModelConfig(hf_config=dict(w.model), seed=0, freeze=tuple(w.freeze)),
        OptimConfig(
            lr=w.lr,
            weight_decay=w.weight_decay,
            warmup_steps=w.lr_warmup,
            total_steps=w.steps,
            min_lr_ratio=w.min_lr_ratio,
            schedule="cosine",
            layer_lr_decay=w.layer_lr_decay,
        ),
        EngineConfig(
            backend=w.engine,
            zero_stage=w.zero_stage,
            precision=w.precision,
            micro_batch=w.micro_batch,
            grad_clip=w.grad_clip,
        ),
    )


def _reset(train_engine: Any, initial: list[Any]) -> None:
    from layercheck.workers.engine import seek_step
    from layercheck.workers.layer_state import restore_from_shards

    restore_from_shards(train_engine.layout, initial)
    seek_step(train_engine, 0)
    train_engine.optimizer.take_drift()


class Runner:
    """One rank's benchmark: the engine, the data, and one method per strategy run."""

    def __init__(self, workload: Workload, root: Path, *, keep: bool = False, s3: LoopbackBucket | None = None) -> None:
        import transformers  # noqa: F401 — imported before timing the engine build

        from layercheck.workers.data.dataset import DataConfig, SequenceDataset
        from layercheck.workers.engine import build_engine
        from layercheck.workers.env import init_distributed
        from layercheck.workers.host_buffers import HostBufferPool
        from layercheck.workers.layer_state import snapshot_layers

        self.workload = workload
        self.root = root
        self.keep = keep
        self.s3 = s3
        """Where the layer stores go (``--store s3-loopback``); ``None``: under ``root``."""
        self._runs = 0  # strategy runs so far (alike on every rank): a fresh S3 prefix per run
        model_cfg, optim_cfg, engine_cfg = _configs(workload)
        if workload.engine == "deepspeed":
            import deepspeed  # noqa: F401 — imported before timing the engine build
        # outside the timed build: a one-off JIT of DeepSpeed's shm op on CPU
        init_distributed(engine=workload.engine)
        started = time.monotonic()
        self.train_engine = build_engine(model_cfg, optim_cfg, engine_cfg)
        self.build_s = time.monotonic() - started
        self.probe = TimedProbe(self.train_engine.probe)
        self.train_engine.probe = self.probe
        self.rank = torch.distributed.get_rank()
        self.world_size = torch.distributed.get_world_size()
        self.dataset = SequenceDataset.from_config(DataConfig(seq_len=workload.seq_len, seed=0))
        layout, names = self.train_engine.layout, self.train_engine.layer_map.names
        # every element this rank restores (ZeRO-0: whole parameters, more than it owns)
        needed = {name: layout[name].needed for name in names}
        initial = snapshot_layers(layout, names, HostBufferPool(pin=False), step=0, pieces=needed)
        self.initial = [_clone_shard(s) for s in initial]

    def batches(self, step: int) -> list[torch.Tensor]:
        return [
            self.dataset.micro_batch(
                step=step,
                micro=0,
                rank=self.rank,
                world_size=self.world_size,
                micro_batch=self.workload.micro_batch,
                grad_accum=1,
            )
        ]

    def run(self, strategy: Strategy, *, observe: Callable[[int], None] | None = None) -> dict[str, Any]:
        """Train ``strategy`` over the workload; ``observe(step)`` runs on every rank after each
        step (after the strategy's own hook), e.g. to record the state at chosen steps."""
        w, train_engine = self.workload, self.train_engine
        _reset(train_engine, self.initial)
        self.probe.measure_every(strategy.loop_policy.drift_every)  # as the product's ranks would
        directory = self.root / strategy.name
        if self.rank == 0 and directory.exists():
            shutil.rmtree(directory)
        torch.distributed.barrier()
        directory.mkdir(parents=True, exist_ok=True)
        self._runs += 1
        where = self.s3.uri(f"{self.root.name}/{self._runs}-{strategy.name}") if self.s3 else str(directory / "store")
        store = LayerStore.open(where, fsync=True)
        persistence = PersistenceConfig()
        coordinator = LocalCoordinator(
            policy=build_policy(strategy.loop_policy, train_engine.layer_map.numel),
            layer_numel=train_engine.layer_map.numel,
            store=store,
            run_id=strategy.name,
            max_inflight_bytes=persistence.max_inflight_bytes,
            max_versions_in_flight=persistence.max_versions_in_flight,
            drift_every=strategy.loop_policy.drift_every,
            write_budget=persistence.write_budget,  # the product's default: on
            **coordinator_options(strategy),
        )

        def losses() -> dict[int, float]:  # rank 0's: only it hears the loop's progress
            return {p.step: p.loss for p in coordinator.progress_log}

        baseline = make_baseline(
            train_engine,
            strategy,
            directory,
            coordinator,
            batches=self.batches,
            losses=losses,
            reset=lambda: _reset(train_engine, self.initial),
        )
        recoveries: list[dict[str, Any]] = []
        recovering_s = 0.0

        def on_failure(t_fail: int) -> int:
            nonlocal recovering_s
            truth = owned_weights(train_engine.layout)  # ground truth at t_fail, outside the timings
            started = time.monotonic()
            wipe_training_state(train_engine)
            recovered = baseline.recover(t_fail) if baseline is not None else self._recover(coordinator)
            recovering_s += time.monotonic() - started
            unsaved = unsaved_at_recovery(train_engine.layout, truth, lost_rank=self.world_size - 1)
            recoveries.append({"t_fail": t_fail, **recovered, "unsaved": unsaved})
            return recovered["start_step"]

        probe_before = self.probe.seconds
        torch.distributed.barrier()
        started = time.monotonic()
        train_with_failures(
            train_engine,
            self.dataset,
            coordinator,
            start_step=1,
            end_step=w.steps,
            rank=self.rank,
            world_size=self.world_size,
            fail_after=w.failures if strategy.kind is not Kind.NONE else (),
            on_failure=on_failure,
            after_step=_chain(baseline.after_step if baseline else None, observe),
        )
        train_s = time.monotonic() - started - recovering_s
        baseline_bytes, baseline_events = baseline.finish() if baseline is not None else (0, 0)
        coordinator.close()
        written = coordinator.writer.stats.written_bytes
        total_bytes = sum_all(float(written + baseline_bytes))
        capture_bytes = sum_all(float(coordinator.writer.stats.capture_bytes))  # in total_bytes too
        recoveries = [slowest_timings(r) for r in recoveries]
        # read the manifest before the store goes: after it, every version would look uncommitted
        persisted = persisted_steps(coordinator, baseline) if self.rank == 0 else {}
        torch.distributed.barrier()
        if self.rank == 0 and not self.keep:  # a large model's checkpoints would fill the disk
            shutil.rmtree(directory, ignore_errors=True)
        if self.rank != 0:
            return {}
        progress = coordinator.progress_log
        # unmeasured steps (drift_every > 1) take the drift of the measurement that follows them
        trace = {o.step: o for o in filled(coordinator.service.trace)}
        freshness = replay_freshness(train_engine.layer_map.numel, trace, persisted, recoveries, strategy, w)
        out = {
            "strategy": strategy.to_json(),
            "train_s": train_s,
            "compute_median_s": statistics.median(p.compute_s for p in progress),
            "stall_s": sum(p.stall_s for p in progress) + (baseline.stall_s if baseline is not None else 0.0),
            "probe_s": self.probe.seconds - probe_before + sum(p.coordination_s for p in progress),
            "probe_read_s": self.probe.seconds - probe_before,  # the drift probe's host reads alone
            # its own work inside the steps (the copies and norms beside the update), as the summary counts it
            "probe_work_s": sum(p.probe.seconds for p in progress if p.probe is not None),
            "bytes_written": total_bytes,
            "capture_bytes": capture_bytes,
            "events": len(coordinator.handed) + baseline_events,
            "freshness": freshness,
            "drift_every": strategy.loop_policy.drift_every,
            "recoveries": recoveries,
            "losses": {str(p.step): p.loss for p in progress},
            "commits": commits(coordinator),
            "handed_state_bytes": handed_bytes(coordinator.handed, train_engine.layer_map.numel),
        }
        if strategy.kind is Kind.NONE:
            drifts = {s: dict(o.drift) for s, o in trace.items()}
            out["trace"] = trace_of(train_engine.layer_map.numel, drifts, {s: o.lr for s, o in trace.items()}).to_json()
        return out

    def _recover(self, coordinator: LocalCoordinator) -> dict[str, Any]:
        """LayerCheck's recovery, the product's code; from the initial weights if nothing was committed."""
        recovered = recover(self.train_engine, coordinator)
        if recovered.records is None:
            _reset(self.train_engine, self.initial)
        return {
            "resume_after": recovered.start_step - 1,
            "start_step": recovered.start_step,
            "plan_s": recovered.plan_s,
            "load_s": recovered.load_s,
            "replay_s": 0.0,
            "drain_s": recovered.drain_s,
            "sources": dict(recovered.sources),
            "composite_bytes": composite_bytes(recovered.records or {}, recovered.overlays),
            "weighted_staleness": recovered.weighted_staleness,
            "max_staleness": recovered.max_staleness,
            "versions": recovered.versions,
        }


def composite_bytes(records: Mapping[str, Any], overlays: Mapping[str, Sequence[Any]]) -> int:
    """The bytes of the versions a recovery's composite names, whole and overlaid: what its
    loads should read, summed over ranks."""
    return sum(r.nbytes for r in records.values()) + sum(v.nbytes for layer in overlays.values() for v in layer)


def coordinator_options(strategy: Strategy) -> dict[str, Any]:
    """The :class:`LocalCoordinator` options of the strategy's recovery tiers: the survivors'
    capture, the writers' memory tier at the product's default budget, its memory versions."""
    return {
        "capture": strategy.capture,
        "memory_bytes": PersistenceConfig().memory_bytes if strategy.memory else 0,
        "memory_period": strategy.memory_period,
    }


def _chain(*hooks: Callable[[int], None] | None) -> Callable[[int], None]:
    chosen = [h for h in hooks if h is not None]

    def run(step: int) -> None:
        for hook in chosen:
            hook(step)

    return run


def _clone_shard(shard: LayerShard) -> LayerShard:
    from dataclasses import replace

    return replace(shard, tensors={k: v.clone() for k, v in shard.tensors.items()})
