"""What one strategy's run measured, as the benchmark's ranks account for it: the state handed
to the writers, the supervisor's commits, the steps whose state was saved, the freshness replayed
over the run, each recovery's timings (the slowest rank's), and the collectives that reduce them."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from layercheck.bench.formulas import FreshnessTracker
from layercheck.bench.presets import Workload
from layercheck.bench.strategies import Recovery, Strategy
from layercheck.orchestrator.local.local_coordinator import LocalCoordinator
from layercheck.policies.staggered import BYTES_PER_PARAM


def handed_bytes(handed: list[tuple[int, tuple[str, ...]]], numel: Mapping[str, int]) -> dict[str, int]:
    """What the loop handed to the writers (all ranks together): total and the most at one
    step, as layer state (fp32 weights and both Adam moments, 12 bytes a parameter) — the
    unit the schedule plans in and the oracle counts."""
    per_step: dict[int, int] = {}
    for step, layers in handed:
        per_step[step] = per_step.get(step, 0) + sum(numel[n] for n in layers) * BYTES_PER_PARAM
    return {"total": sum(per_step.values()), "peak_step": max(per_step.values(), default=0)}


def commits(coordinator: LocalCoordinator) -> dict[str, int]:
    """Rank 0: what the run's supervisor committed, retried and lost (its ``RunView`` status)."""
    status = coordinator.status() or {}
    return {
        key: status.get(key, 0) for key in ("versions_committed", "commit_retries", "lost_versions", "write_failures")
    }


def persisted_steps(coordinator: LocalCoordinator, baseline: Any) -> dict[int, set[str]]:
    """Per step, the layers whose state taken at that step was saved: LayerCheck's committed
    versions (rank 0), and the baseline's own checkpoints."""
    out: dict[int, set[str]] = {}
    if coordinator.run is not None:
        for layer, step in coordinator.committed():
            out.setdefault(step, set()).add(layer)
    for step, names in (baseline.persisted if baseline is not None else {}).items():
        out.setdefault(step, set()).update(names)
    return out


def replay_freshness(
    numel: Mapping[str, int],
    trace: Mapping[int, Any],
    persisted: Mapping[int, set[str]],
    recoveries: list[dict[str, Any]],
    strategy: Strategy,
    w: Workload,
) -> dict[str, float]:
    """Replay the run's freshness: per step its drift and what was saved, and each recovery.
    A rollback's staleness at the failure is the tracker's (its recovery reports none)."""
    tracker = FreshnessTracker(numel=numel, eval_from=w.strategy.layercheck_warmup)
    by_fail = {r["t_fail"]: r for r in recoveries}
    for step in range(1, w.steps + 1):
        tracker.observe(step, trace[step].drift if step in trace else {}, persisted.get(step, ()))
        recovery = by_fail.get(step)
        if recovery is None:
            continue
        if strategy.recovery is not Recovery.RESUME:
            recovery["weighted_staleness"] = tracker.weighted_staleness_now(step)
            recovery["max_staleness"] = tracker.max_staleness_now(step)
        if recovery.get("versions"):
            tracker.recovered(recovery["versions"])
    for recovery in recoveries:
        recovery.pop("versions", None)
    return tracker.summary()


def slowest_timings(recovery: dict[str, Any]) -> dict[str, Any]:
    """A recovery's timings as the slowest rank's (collective); its step counts and the rest as they are."""
    keys = ("plan_s", "load_s", "replay_s", "drain_s")
    timings = max_all([float(recovery.get(k, 0.0)) for k in keys])
    out = {**recovery, **dict(zip(keys, timings))}
    out.pop("start_step", None)
    out["steps_lost"] = out["t_fail"] - out["resume_after"]
    out["recovery_s"] = out["plan_s"] + out["load_s"] + out["replay_s"]
    out.setdefault("replay_max_loss_diff", 0.0)
    out.setdefault("weighted_staleness", 0.0)
    out.setdefault("max_staleness", 0)
    return out


def _all_reduce(values: list[float], op: Any) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64)
    if torch.distributed.get_backend() == "nccl":
        t = t.cuda()
    torch.distributed.all_reduce(t, op=op)
    return t.cpu().tolist()


def sum_all(value: float) -> float:
    return _all_reduce([value], torch.distributed.ReduceOp.SUM)[0]


def max_all(values: list[float]) -> list[float]:
    return _all_reduce(values, torch.distributed.ReduceOp.MAX)


def broadcast(value: Any) -> Any:
    box = [value]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]
