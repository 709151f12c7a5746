"""Which freshness predicts the damage: many failure points per strategy, cheaply.

    python bench/probes/freshness.py [--preset tiny] [--workload default] [--points 12] [--horizon 20] [--json]

On one spawn of the ranks (as :mod:`layercheck.bench.harness`): the reference (``none``) trains the workload
failure-free, recording its losses, its drift trace and, at every failure point, each layer's
fp32 weights. Every strategy then trains the same run failure-free through the product's loop
and writers, keeping its store. For each failure point ``t`` and each strategy, the engine is
wiped, the composite at ``t`` (the newest committed version of every layer at or before ``t``,
what a drained recovery loads) is loaded by the product's ``load_composite``, and ``horizon``
steps are trained from ``t + 1`` on the same batches: the loss deviation is
``|loss - reference loss|`` over those steps. All runs are failure-free, so every point starts
from the same history and costs ``horizon`` steps. The measures (``correlation.py`` beside it) are
taken at each point, and each one's Pearson and Spearman correlation with the loss deviation is
reported, pooled over strategies and per strategy.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import correlation  # beside it in bench/probes/
import torch

from layercheck.bench.presets import PRESETS, VARIANTS, Workload, preset, variant
from layercheck.bench.strategies import Kind, Strategy, default_strategies, select
from layercheck.orchestrator.logs import configure_process_logging
from layercheck.orchestrator.table import format_table

if TYPE_CHECKING:
    from layercheck.workers.engine import TrainEngine

logger = logging.getLogger(__name__)

DEFAULT_STRATEGIES = ("staggered", "layercheck", "layercheck-const", "full-resume", "drift-optimal")


def failure_points(w: Workload, count: int, horizon: int) -> list[int]:
    """``count`` steps spread evenly from one full period after the warm-up (every layer has a
    version by then under every schedule) to ``horizon`` steps before the end."""
    lo = w.strategy.layercheck_warmup + w.strategy.interval + 1
    hi = w.steps - horizon
    if hi <= lo:
        raise ValueError(f"no room for failure points: steps {w.steps} <= warm-up + interval + horizon")
    count = min(count, hi - lo + 1)
    return sorted({lo + round(i * (hi - lo) / max(1, count - 1)) for i in range(count)})


def _owned_fp32(train_engine: TrainEngine) -> dict[str, torch.Tensor]:
    """This rank's owned fp32 weights of every layer, flat (cloned)."""
    from layercheck.workers.host_buffers import HostBufferPool
    from layercheck.workers.layer_state import snapshot_layers

    shards = snapshot_layers(train_engine.layout, list(train_engine.layer_map.names), HostBufferPool(pin=False))
    return {s.layer: s.tensors["fp32"].clone() for s in shards}


def _sum_layers(train_engine: TrainEngine, per_layer: Mapping[str, float]) -> dict[str, float]:
    names = list(train_engine.layer_map.names)
    t = torch.tensor([per_layer[n] for n in names], dtype=torch.float64)
    if torch.distributed.get_backend() == "nccl":
        t = t.cuda()
    torch.distributed.all_reduce(t)
    return dict(zip(names, t.cpu().tolist()))


def _mean_abs(train_engine: TrainEngine, weights: Mapping[str, torch.Tensor]) -> dict[str, float]:
    sums = _sum_layers(train_engine, {n: float(w.double().abs().sum()) for n, w in weights.items()})
    return {n: sums[n] / train_engine.layer_map.numel[n] for n in sums}


def _replay(runner: Any, store: Any, t: int, horizon: int, at_t: Mapping[str, torch.Tensor]) -> dict[str, Any] | None:
    """Load the composite at ``t`` from ``store``, train ``horizon`` steps; this rank's losses,
    the versions loaded and the exact per-layer distance to the lost state (all ranks)."""
    from layercheck.orchestrator.core.recovery.composite import load_composite
    from layercheck.orchestrator.local.run import wipe_training_state
    from layercheck.orchestrator.store.recovery_source import resolve_plan
    from layercheck.policies.plan import NoUsableVersionError
    from layercheck.workers.engine import seek_step
    from layercheck.workers.step import train_step

    train_engine = runner.train_engine
    try:
        records = resolve_plan(store, train_engine.layer_map.numel, t, deep=False).records
    except NoUsableVersionError:
        return None
    wipe_training_state(train_engine)
    load_composite(train_engine, store, records)
    seek_step(train_engine, t)
    train_engine.optimizer.take_drift()
    recovered = _owned_fp32(train_engine)
    distance = _sum_layers(train_engine, {n: float((recovered[n] - at_t[n]).double().abs().sum()) for n in recovered})
    losses = {t + k: train_step(train_engine, runner.batches(t + k))[0] for k in range(1, horizon + 1)}
    return {
        "versions": {n: r.step for n, r in records.items()},
        "lost_distance_per_layer": {n: distance[n] / train_engine.layer_map.numel[n] for n in distance},
        "losses": losses,
    }


def rank_main(rank: int, world_size: int, payload: Mapping[str, Any]) -> dict[str, Any]:
    from layercheck.bench.harness import quiet_rank
    from layercheck.bench.runner import Runner
    from layercheck.orchestrator.store.layer_store import LayerStore
    from layercheck.workers.engine import shutdown

    quiet_rank()
    w = Workload.from_json(payload["workload"])
    points, horizon = list(payload["points"]), int(payload["horizon"])
    strategies = [Strategy.from_json(s) for s in payload["strategies"]]
    runner = Runner(w, Path(payload["root"]), keep=True)
    at_points: dict[int, dict[str, torch.Tensor]] = {}

    def record(step: int) -> None:
        if step in at_points or step not in points:
            return
        at_points[step] = _owned_fp32(runner.train_engine)

    reference = runner.run(Strategy(name="none", kind=Kind.NONE), observe=record)
    scale = {t: _mean_abs(runner.train_engine, at_points[t]) for t in points}
    out: list[dict[str, Any]] = []
    for strategy in strategies:
        runner.run(strategy)
        store = LayerStore.open(str(Path(payload["root"]) / strategy.name / "store"))
        for t in points:
            replayed = _replay(runner, store, t, horizon, at_points[t])
            if replayed is not None and rank == 0:
                out.append({"strategy": strategy.name, "t_fail": t, **replayed})
        if rank == 0:
            logger.warning("freshness: %s done (%d points)", strategy.name, len(points))
    shutdown(runner.train_engine)
    if rank != 0:
        return {}
    return {
        "reference": reference,
        "scale": {str(t): s for t, s in scale.items()},
        "replays": out,
        "numel": dict(runner.train_engine.layer_map.numel),
    }


def analyse(raw: Mapping[str, Any], *, horizon: int) -> dict[str, Any]:
    """Per point: the four measures and the loss deviation; then the correlations (pure)."""
    numel = raw["numel"]
    ref_losses = {int(k): float(v) for k, v in raw["reference"]["losses"].items()}
    drift = {int(s["step"]): s["drift"] for s in raw["reference"]["trace"]["steps"]}
    points = []
    for r in raw["replays"]:
        t, versions = r["t_fail"], r["versions"]
        devs = [abs(float(loss) - ref_losses[int(s)]) for s, loss in r["losses"].items()]
        points.append(
            {
                "strategy": r["strategy"],
                "t_fail": t,
                "versions": versions,
                "weighted_staleness": correlation.weighted_staleness(numel, versions, t),
                "unsaved_drift": correlation.unsaved_drift(numel, versions, t, drift),
                "unsaved_drift_relative": correlation.unsaved_drift(
                    numel, versions, t, drift, scale=raw["scale"][str(t)]
                ),
                "lost_distance": correlation.weighted_mean(numel, r["lost_distance_per_layer"]),
                "loss_dev_mean": statistics.fmean(devs),
                "loss_dev_max": max(devs),
            }
        )
    by_strategy = {}
    for name in dict.fromkeys(p["strategy"] for p in points):
        by_strategy[name] = correlation.correlations([p for p in points if p["strategy"] == name])
    return {
        "horizon": horizon,
        "points": points,
        "pooled": correlation.correlations(points),
        "pooled_max": correlation.correlations(points, target="loss_dev_max"),
        "by_strategy": by_strategy,
    }


def table(result: Mapping[str, Any]) -> str:
    rows = [
        ["pooled (mean |dloss|)", *(_pair(result["pooled"][m]) for m in correlation.MEASURES)],
        ["pooled (max |dloss|)", *(_pair(result["pooled_max"][m]) for m in correlation.MEASURES)],
    ]
    rows += [[name, *(_pair(c[m]) for m in correlation.MEASURES)] for name, c in result["by_strategy"].items()]
    head = format_table(["points", *correlation.MEASURES], rows)
    pts = [
        [
            p["strategy"],
            p["t_fail"],
            p["weighted_staleness"],
            p["unsaved_drift"],
            p["unsaved_drift_relative"],
            p["lost_distance"],
            p["loss_dev_mean"],
            p["loss_dev_max"],
        ]
        for p in result["points"]
    ]
    return (
        f"Pearson / Spearman of each freshness measure with the loss deviation over the next "
        f"{result['horizon']} steps ({len(result['points'])} failure points)\n{head}\n\n"
        + format_table(
            ["strategy", "t_fail", "w-stal", "unsaved drift", "relative", "lost dist", "dev mean", "dev max"], pts
        )
    )


def _pair(c: Mapping[str, float]) -> str:
    return f"{c['pearson']:+.2f} / {c['spearman']:+.2f}"


def _rank_entry(rank: int, world_size: int, payload: Mapping[str, Any]) -> dict[str, Any]:
    if payload["workload"]["device"] == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    else:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    configure_process_logging(timestamps=True)
    return rank_main(rank, world_size, payload)


def run_sweep(
    w: Workload, strategies: Sequence[Strategy], *, points: int, horizon: int, timeout_s: float = 3600.0
) -> dict[str, Any]:
    """Spawn the ranks, run the sweep, analyse it (rank 0's raw measurements under ``raw``)."""
    from layercheck.orchestrator.local.spawn import spawn_ranks

    w = replace(w, failures=())
    steps = failure_points(w, points, horizon)
    root = Path(tempfile.mkdtemp(prefix="layercheck-freshness-"))
    payload = {
        "workload": w.to_json(),
        "strategies": [s.to_json() for s in strategies],
        "root": str(root),
        "points": steps,
        "horizon": horizon,
    }
    try:
        raw = spawn_ranks(_rank_entry, w.world_size, payload, timeout_s=timeout_s, what=f"freshness sweep ({w.name})")[
            0
        ]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    result = analyse(raw, horizon=horizon)
    return {"workload": w.to_json(), "failure_points": steps, **result}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python bench/probes/freshness.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    p.add_argument("--workload", choices=VARIANTS, default="default")
    p.add_argument(
        "--strategies",
        default=",".join(DEFAULT_STRATEGIES),
        help="comma-separated resume strategies (rollbacks re-run lost steps exactly: no deviation)",
    )
    p.add_argument("--points", type=int, default=12, help="failure points per strategy")
    p.add_argument("--horizon", type=int, default=20, help="K: steps trained after each recovery")
    p.add_argument("--out", type=Path, help="write freshness.json here")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    configure_process_logging(timestamps=True)
    w = variant(preset(args.preset), args.workload)
    chosen = select(default_strategies(w.strategy), [s.strip() for s in args.strategies.split(",")])[1:]
    result = run_sweep(w, chosen, points=args.points, horizon=args.horizon)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "freshness.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1) if args.json else table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
