"""The benchmark's process code: spawn the ranks, train every strategy on LayerCheck's own loop.

One spawn of ``world_size`` processes (gloo on CPU / NCCL on CUDA,
:func:`layercheck.orchestrator.local.spawn.spawn_ranks`) trains all strategies one after another on one
DeepSpeed engine, reset to the same initial state before each, so every strategy sees the same
model, data, seed, steps and failures, in one invocation on one machine state.

One strategy's run on a rank is :class:`layercheck.bench.runner.Runner`'s; here is what a rank
does around those runs (the strategies in turn, the matched variants, the repeats, the partial
results) and how the ranks are spawned.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from layercheck.bench.matched import matched_settings
from layercheck.bench.presets import Workload
from layercheck.bench.run_record import broadcast, max_all
from layercheck.bench.runner import Runner
from layercheck.bench.s3_loopback import STORES, LoopbackBucket, loopback_s3
from layercheck.bench.strategies import Strategy, matched_variants
from layercheck.orchestrator.local.spawn import spawn_ranks
from layercheck.orchestrator.logs import configure_process_logging

logger = logging.getLogger(__name__)

#: The figures a repeated strategy reports as their median over the repeats.
REPEATED = ("train_s", "stall_s", "probe_s", "probe_read_s", "probe_work_s")


def quiet_rank() -> None:
    """A benchmark rank's console: warnings off, and only warnings from the product and its stack
    (the per-step decisions would drown the figures)."""
    warnings.filterwarnings("ignore")
    for name in (
        "layercheck.workers",
        "layercheck.orchestrator",
        "layercheck.policies",
        "DeepSpeed",
        "deepspeed",
        "torch",
    ):
        logging.getLogger(name).setLevel(logging.WARNING)


def rank_main(rank: int, world_size: int, payload: Mapping[str, Any]) -> dict[str, Any]:
    """Everything one rank does: build, run each strategy (plus the matched variants), report."""
    from layercheck.workers.engine import shutdown

    quiet_rank()
    workload = Workload.from_json(payload["workload"])
    strategies = [Strategy.from_json(s) for s in payload["strategies"]]
    s3 = LoopbackBucket(**payload["s3"]) if payload.get("s3") else None
    runner = Runner(workload, Path(payload["root"]), keep=bool(payload.get("keep")), s3=s3)
    partial = payload.get("partial") if rank == 0 else None
    results: dict[str, Any] = {}
    order = list(strategies)
    ran_matched = not payload.get("matched", True)
    i = 0
    while i < len(order):
        strategy = order[i]
        results[strategy.name] = runner.run(strategy)
        if rank == 0:
            logger.warning("bench: %s done (%.1fs training)", strategy.name, results[strategy.name]["train_s"])
        if partial is not None:
            _write_partial(
                Path(partial["path"]), results, runner, workload=payload["workload"], machine=partial["machine"]
            )
        i += 1
        if not ran_matched and i == len(order) and "layercheck" in results and "none" in results:
            matched = None
            if rank == 0:
                matched = matched_settings(results, workload, strategies)
            matched = broadcast(matched)
            results["_matched"] = matched
            order += matched_variants(
                strategies,
                staleness_interval=matched["staleness"],
                drift_interval=matched["drift"],
                bytes_intervals=matched["bytes"],
            )
            ran_matched = True
    for repeat in range(1, int(payload.get("repeats", 1))):
        for strategy in reversed(order) if repeat % 2 else order:
            again = runner.run(strategy)
            if rank != 0:
                continue  # only rank 0 reports
            for key in REPEATED:
                results[strategy.name].setdefault(f"{key}_repeats", [results[strategy.name][key]]).append(again[key])
    for result in results.values():
        for key in REPEATED:
            if isinstance(result, dict) and f"{key}_repeats" in result:
                result[key] = statistics.median(result[f"{key}_repeats"])
    restart_s = max_all([runner.build_s])[0]
    shutdown(runner.train_engine)
    if rank != 0:
        return {}
    return {"results": results, "restart_s": restart_s, **_model_figures(runner)}


def _model_figures(runner: Runner) -> dict[str, Any]:
    """The trained model's size: its layers' parameters, each layer's, and the frozen rest."""
    layers = dict(runner.train_engine.layer_map.numel)
    model_params = sum(
        p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in runner.train_engine.adapter.module.parameters()
    )
    return {"params": sum(layers.values()), "layers": layers, "frozen_params": model_params - sum(layers.values())}


def _write_partial(
    path: Path, results: Mapping[str, Any], runner: Runner, *, workload: Mapping[str, Any], machine: Mapping[str, Any]
) -> None:
    """Rank 0, after each strategy: what has run so far, as ``layercheck bench --rebuild`` reads a
    ``bench.json``, so that a run stopped part-way (a time limit, a lost machine) still reports the
    strategies that finished. Its restart is this rank's engine build alone (the worker imports
    are measured once every rank has ended); replaced atomically, never half written."""
    raw = {"results": dict(results), "restart_s": runner.build_s, **_model_figures(runner)}
    document = {"partial": True, "raw": raw, "workload": dict(workload), "machine": dict(machine)}
    scratch = path.with_name(path.name + ".tmp")
    scratch.write_text(json.dumps(document))
    os.replace(scratch, path)


# ---- spawning ------------------------------------------------------------------------------


def _rank_entry(rank: int, world_size: int, payload: Mapping[str, Any]) -> dict[str, Any]:
    if payload["workload"]["device"] == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    else:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    configure_process_logging(timestamps=True)
    return rank_main(rank, world_size, payload)


def run_benchmark(
    workload: Workload,
    strategies: list[Strategy],
    *,
    root: Path | None = None,
    matched: bool = True,
    repeats: int = 1,
    timeout_s: float = 3600.0,
    store: str = "local",
    partial: Path | None = None,
) -> dict[str, Any]:
    """Spawn the ranks and run every strategy; rank 0's raw measurements. ``store``: where the
    layer stores go: ``local`` (under ``root``) or ``s3-loopback`` (a moto server this call starts
    on loopback; the DeepSpeed baselines' own checkpoints stay under ``root``). ``partial``: a
    file rewritten after each strategy with the results so far (:func:`_write_partial`)."""
    if store not in STORES:
        raise ValueError(f"store must be one of {STORES}, got {store!r}")
    if store == "s3-loopback":
        with loopback_s3() as s3:
            raw = _run(workload, strategies, root, matched, repeats, timeout_s, s3=s3, partial=partial)
        return {**raw, "store": f"{store} (moto at {s3.endpoint})"}
    return {**_run(workload, strategies, root, matched, repeats, timeout_s, partial=partial), "store": store}


#: What a restarted worker process imports before it can build its engine (Ray Train's worker,
#: LayerCheck's train function, and through them torch, DeepSpeed and transformers).
WORKER_IMPORTS = "import ray.train.torch, deepspeed, transformers, layercheck.orchestrator.runtime.train_fn"


def worker_imports_s() -> float:
    """Seconds a fresh Python process takes to start and import :data:`WORKER_IMPORTS`: the
    part of a restart that comes before the engine build (measured, in a subprocess)."""
    started = time.monotonic()
    subprocess.run([sys.executable, "-c", WORKER_IMPORTS], check=True, capture_output=True, timeout=600)
    return time.monotonic() - started


def _run(
    workload: Workload,
    strategies: list[Strategy],
    root: Path | None,
    matched: bool,
    repeats: int,
    timeout_s: float,
    *,
    s3: LoopbackBucket | None = None,
    partial: Path | None = None,
) -> dict[str, Any]:
    from layercheck.bench.machine import describe

    keep = root is not None
    root = root or Path(tempfile.mkdtemp(prefix="layercheck-bench-"))
    payload = {
        "s3": {"port": s3.port, "bucket": s3.bucket} if s3 is not None else None,
        "workload": workload.to_json(),
        "strategies": [s.to_json() for s in strategies],
        "root": str(root.resolve()),
        "matched": matched,
        "repeats": repeats,
        "keep": keep,
        "partial": {"path": str(partial.resolve()), "machine": describe()} if partial is not None else None,
    }
    try:
        raw = spawn_ranks(
            _rank_entry, workload.world_size, payload, timeout_s=timeout_s, what=f"benchmark ({workload.name})"
        )[0]
        imports_s = worker_imports_s()
        return {
            **raw,
            "restart_s": imports_s + raw["restart_s"],
            "restart_parts": {"worker_imports_s": imports_s, "engine_build_s": raw["restart_s"]},
        }
    finally:
        if not keep:
            shutil.rmtree(root, ignore_errors=True)
