"""The benchmark's process code: spawn the ranks, train every strategy, measure.

One spawn of ``world_size`` processes (torch.multiprocessing, gloo on CPU / NCCL on CUDA) trains
all strategies one after another on one DeepSpeed engine, reset to the same initial state
before each, so every strategy sees the same model, data, seed, steps and failures, in one
invocation on one machine state. Each rank runs the project's real pieces: ``build_engine``,
``train_step``, the drift probe and ``global_drift``, the real policies, ``snapshot_layers`` +
``LayerStore`` writes and commits from a background thread, ``resolve_plan`` +
``load_composite`` for recovery, and DeepSpeed's own ``save_checkpoint``/``load_checkpoint``.

A failure at step F: writes in flight finish (a real persistence pool outlives the trainer),
every layer's weights and moments are overwritten with NaN (a missed layer shows up as a NaN
loss), and the strategy recovers its way; rollback strategies re-run the lost steps (timed).
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import statistics
import tempfile
import time
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from bench.metrics import FreshnessTracker, matched_intervals, trace_of
from bench.persistence import make_persistence
from bench.presets import Workload
from bench.strategies import Kind, Recovery, Strategy, matched_variants
from orchestrator.logs import configure_process_logging
from workers.spawn import exit_without_teardown

logger = logging.getLogger(__name__)


class TimedProbe:
    """The engine's drift probe with the time of its ``collect`` (the per-step host read) summed."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.seconds = 0.0

    @property
    def numel(self) -> Any:
        return self.inner.numel

    def collect(self, step: int) -> Any:
        started = time.monotonic()
        try:
            return self.inner.collect(step)
        finally:
            self.seconds += time.monotonic() - started


def _configs(w: Workload) -> tuple[Any, Any, Any]:
    from workers.config import EngineConfig, ModelConfig, OptimConfig

    return (
        ModelConfig(hf_config=dict(w.model), seed=0),
        OptimConfig(lr=w.lr, weight_decay=w.weight_decay, warmup_steps=w.lr_warmup, total_steps=w.steps,
                    min_lr_ratio=w.min_lr_ratio, schedule="cosine"),
        EngineConfig(zero_stage=w.zero_stage, precision=w.precision, micro_batch=w.micro_batch, grad_clip=w.grad_clip),
    )


def _wipe(te: Any) -> None:
    """The rank's in-memory training state is gone: every layer becomes NaN, step 0."""
    from workers.engine import seek_step
    from workers.layer_state import LayerMeta, restore_layers

    metas = {name: LayerMeta(optimizer_step=0) for name in te.layer_map.names}
    restore_layers(te.layout, metas, lambda name, key, offset, length: torch.full((length,), math.nan))
    seek_step(te, 0)


def _reset(te: Any, initial: list[Any]) -> None:
    from workers.engine import seek_step
    from workers.layer_state import restore_from_shards

    restore_from_shards(te.layout, initial)
    seek_step(te, 0)
    te.optimizer.take_drift()


class Runner:
    """One rank's benchmark: the engine, the data, and one method per strategy run."""

    def __init__(self, workload: Workload, root: Path, *, keep: bool = False) -> None:
        import deepspeed  # noqa: F401 — imported before timing the engine build
        import transformers  # noqa: F401

        from workers.data import DataConfig, SequenceDataset
        from workers.engine import build_engine
        from workers.host_buffers import HostBufferPool
        from workers.layer_state import snapshot_layers

        self.workload = workload
        self.root = root
        self.keep = keep
        from workers.env import init_distributed

        model_cfg, optim_cfg, engine_cfg = _configs(workload)
        init_distributed()  # outside the timed build: a one-off JIT of DeepSpeed's shm op on CPU
        started = time.monotonic()
        self.te = build_engine(model_cfg, optim_cfg, engine_cfg)
        self.build_s = time.monotonic() - started
        self.probe = TimedProbe(self.te.probe)
        self.te.probe = self.probe
        self.rank = torch.distributed.get_rank()
        self.world_size = torch.distributed.get_world_size()
        self.dataset = SequenceDataset.from_config(DataConfig(seq_len=workload.seq_len, seed=0))
        self.initial = snapshot_layers(self.te.layout, self.te.layer_map.names, HostBufferPool(pin=False), step=0)
        self.initial = [_clone_shard(s) for s in self.initial]

    def batches(self, step: int) -> list[torch.Tensor]:
        return [self.dataset.micro_batch(step=step, micro=0, rank=self.rank, world_size=self.world_size,
                                         micro_batch=self.workload.micro_batch, grad_accum=1)]

    def run(self, strategy: Strategy) -> dict[str, Any]:
        from workers.drift import global_drift
        from workers.schedule import lr_at
        from workers.step import train_step

        w = self.workload
        _reset(self.te, self.initial)
        directory = self.root / strategy.name
        if self.rank == 0 and directory.exists():
            shutil.rmtree(directory)
        torch.distributed.barrier()
        persistence = make_persistence(self.te, strategy, directory)
        tracker = FreshnessTracker(numel=self.te.layer_map.numel, eval_from=w.strategy.layercheck_warmup)
        failures = set(w.failures) if strategy.kind is not Kind.NONE else set()
        losses: dict[int, float] = {}
        drifts: dict[int, dict[str, float]] = {}
        lrs: dict[int, float] = {}
        train_s = stall_s = probe_s = 0.0
        compute: list[float] = []
        probe_before = self.probe.seconds
        recoveries = []
        torch.distributed.barrier()
        for step in range(1, w.steps + 1):
            started = time.monotonic()
            loss, local = train_step(self.te, self.batches(step))
            reduced = time.monotonic()
            drift = global_drift(local)
            decided = time.monotonic()
            lr = lr_at(step - 1, self.te.optim_cfg)
            persisted = persistence.after_step(step, lr, drift)
            done = time.monotonic()
            train_s += done - started
            compute.append(reduced - started)
            probe_s += decided - reduced
            stall_s += done - decided
            tracker.observe(step, drift, persisted)
            losses[step], drifts[step], lrs[step] = loss, drift, lr
            if step in failures:
                recoveries.append(self._fail_and_recover(strategy, persistence, tracker, step, losses))
        probe_s += self.probe.seconds - probe_before
        done_info = persistence.finish()
        total_bytes = _sum_all(float(done_info["bytes"]))
        torch.distributed.barrier()
        if self.rank == 0 and not self.keep:  # a large model's checkpoints would fill the disk
            shutil.rmtree(directory, ignore_errors=True)
        out = {
            "strategy": strategy.to_json(),
            "train_s": train_s,
            "compute_median_s": statistics.median(compute),
            "stall_s": stall_s,
            "probe_s": probe_s,
            "bytes_written": total_bytes,
            "events": done_info["events"],
            "freshness": tracker.summary(),
            "recoveries": recoveries,
            "losses": {str(k): v for k, v in losses.items()},
        }
        if strategy.kind is Kind.NONE:
            out["trace"] = trace_of(self.te.layer_map.numel, drifts, lrs).to_json()
        return out

    def _fail_and_recover(self, strategy: Strategy, persistence: Any, tracker: FreshnessTracker, step: int,
                          losses: dict[int, float]) -> dict[str, Any]:
        from workers.step import train_step

        weighted, worst = tracker.weighted_staleness_now(step), tracker.max_staleness_now(step)
        _wipe(self.te)
        recovered = persistence.recover(step)
        if recovered.versions is not None:
            tracker.recovered(recovered.versions)
        if recovered.resume_after == 0 and strategy.recovery is Recovery.ROLLBACK:
            _reset(self.te, self.initial)
        replay_s, replay_diff = 0.0, 0.0
        if strategy.recovery in (Recovery.ROLLBACK, Recovery.RESTART):
            started = time.monotonic()
            for again in range(recovered.resume_after + 1, step + 1):
                loss, _ = train_step(self.te, self.batches(again))
                replay_diff = max(replay_diff, abs(loss - losses[again]))
            replay_s = time.monotonic() - started
        else:
            replay_s = recovered.replay_s
        timings = _max_all([recovered.plan_s, recovered.load_s, replay_s, recovered.drain_s])
        return {
            "t_fail": step,
            "resume_after": recovered.resume_after,
            "steps_lost": step - recovered.resume_after,
            "plan_s": timings[0], "load_s": timings[1], "replay_s": timings[2], "drain_s": timings[3],
            "recovery_s": timings[0] + timings[1] + timings[2],
            "weighted_staleness": recovered.weighted_staleness if strategy.recovery is Recovery.RESUME else weighted,
            "max_staleness": recovered.max_staleness if strategy.recovery is Recovery.RESUME else worst,
            "replay_max_loss_diff": replay_diff,
        }


def _clone_shard(shard: Any) -> Any:
    from dataclasses import replace

    return replace(shard, tensors={k: v.clone() for k, v in shard.tensors.items()})


def _sum_all(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    if torch.distributed.get_backend() == "nccl":
        t = t.cuda()
    torch.distributed.all_reduce(t)
    return float(t.item())


def _max_all(values: list[float]) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64)
    if torch.distributed.get_backend() == "nccl":
        t = t.cuda()
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return t.cpu().tolist()


def _broadcast(value: Any) -> Any:
    box = [value]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


def rank_main(rank: int, world_size: int, payload: Mapping[str, Any]) -> dict[str, Any]:
    """Everything one rank does: build, run each strategy (plus the matched variants), report."""
    from workers.engine import shutdown

    warnings.filterwarnings("ignore")
    for name in ("workers", "orchestrator", "policies", "DeepSpeed", "deepspeed", "torch"):
        logging.getLogger(name).setLevel(logging.WARNING)
    workload = Workload.from_json(payload["workload"])
    strategies = [Strategy.from_json(s) for s in payload["strategies"]]
    runner = Runner(workload, Path(payload["root"]), keep=bool(payload.get("keep")))
    results: dict[str, Any] = {}
    order = list(strategies)
    ran_matched = not payload.get("matched", True)
    i = 0
    while i < len(order):
        strategy = order[i]
        results[strategy.name] = runner.run(strategy)
        if rank == 0:
            logger.warning("bench: %s done (%.1fs training)", strategy.name, results[strategy.name]["train_s"])
        i += 1
        if not ran_matched and i == len(order) and "layercheck" in results and "none" in results:
            matched = None
            if rank == 0:
                matched = _matched(results["none"], results["layercheck"], workload)
            matched = _broadcast(matched)
            results["_matched"] = matched
            order += matched_variants(strategies, staleness_interval=matched["staleness"],
                                      drift_interval=matched["drift"])
            ran_matched = True
    for repeat in range(1, int(payload.get("repeats", 1))):
        for strategy in reversed(order) if repeat % 2 else order:
            again = runner.run(strategy)
            for key in ("train_s", "stall_s", "probe_s"):
                results[strategy.name].setdefault(f"{key}_repeats", [results[strategy.name][key]]).append(again[key])
    for result in results.values():
        for key in ("train_s", "stall_s", "probe_s"):
            if isinstance(result, dict) and f"{key}_repeats" in result:
                result[key] = statistics.median(result[f"{key}_repeats"])
    restart_s = _max_all([runner.build_s])[0]
    shutdown(runner.te)
    if rank != 0:
        return {}
    return {"results": results, "restart_s": restart_s, "params": sum(runner.te.layer_map.numel.values()),
            "layers": dict(runner.te.layer_map.numel)}


def _matched(none: Mapping[str, Any], layercheck: Mapping[str, Any], workload: Workload) -> dict[str, Any]:
    from policies.trace import DriftTrace

    trace = DriftTrace.from_json(none["trace"])
    m = matched_intervals(trace, target_staleness=layercheck["freshness"]["mean_weighted_staleness"],
                          target_drift=layercheck["freshness"]["mean_unsaved_drift"],
                          eval_from=workload.strategy.layercheck_warmup)
    floor = workload.strategy.min_matched_interval
    return {"staleness": max(m.staleness, floor), "drift": max(m.drift, floor),
            "clipped_to_min_interval": floor if min(m.staleness, m.drift) < floor else None,
            "target_staleness": m.target_staleness,
            "target_drift": m.target_drift, "interval_staleness": m.interval_staleness,
            "interval_drift": m.interval_drift}


# ---- spawning ------------------------------------------------------------------------------

def _entry(rank: int, world_size: int, port: int, out_dir: str, payload: Mapping[str, Any]) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if payload["workload"]["device"] == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    else:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    configure_process_logging(timestamps=True)
    try:
        result = rank_main(rank, world_size, payload)
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    exit_without_teardown()  # the result is on disk; a teardown abort must not fail the rank


def run_benchmark(workload: Workload, strategies: list[Strategy], *, root: Path | None = None,
                  matched: bool = True, repeats: int = 1, timeout_s: float = 3600.0) -> dict[str, Any]:
    """Spawn the ranks and run every strategy; rank 0's raw measurements."""
    import torch.multiprocessing as mp

    from workers.env import free_port

    keep = root is not None
    root = root or Path(tempfile.mkdtemp(prefix="layercheck-bench-"))
    payload = {"workload": workload.to_json(), "strategies": [s.to_json() for s in strategies],
               "root": str(root.resolve()), "matched": matched, "repeats": repeats, "keep": keep}
    try:
        with tempfile.TemporaryDirectory(prefix="layercheck-bench-out-") as out_dir:
            context = mp.start_processes(_entry, args=(workload.world_size, free_port(), out_dir, payload),
                                         nprocs=workload.world_size, join=False, start_method="spawn")
            deadline = time.monotonic() + timeout_s
            try:
                while not context.join(timeout=5):
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"benchmark ranks still running after {timeout_s:.0f}s")
            except BaseException:
                for process in context.processes:
                    if process.is_alive():
                        process.kill()
                raise
            return json.loads(Path(out_dir, "rank0.json").read_text())
    finally:
        if not keep:
            shutil.rmtree(root, ignore_errors=True)
