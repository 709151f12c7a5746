"""What ``layercheck bench`` and ``layercheck ettr`` do (registered by ``orchestrator/cli/bench.py``)."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any

from layercheck.bench import ettr as ettr_model
from layercheck.bench import report as reports
from layercheck.bench import report_text, summary
from layercheck.bench.presets import PRESETS, VARIANTS, Workload, preset, variant
from layercheck.bench.s3_loopback import STORES
from layercheck.bench.scale.command import add_scale_arguments
from layercheck.bench.scale.costs import describe as describe_scale
from layercheck.bench.scale.costs import scale_costs
from layercheck.bench.strategies import default_strategies, select
from layercheck.workers.config import BACKENDS

logger = logging.getLogger(__name__)

#: In ``--out``, the results so far while a benchmark runs (``--rebuild`` reads it like a bench.json).
PARTIAL = "partial.json"


def add_bench_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default="tiny",
        help="workload: tiny (CPU, a few minutes) or a Qwen2.5 shape for a GPU machine",
    )
    p.add_argument(
        "--workload",
        choices=VARIANTS,
        default="default",
        help="a variant where layers differ: frozen-half (the first half of the blocks frozen) or "
        "lr-decay-0.8 (layer-wise LR decay 0.8 per block)",
    )
    p.add_argument("--steps", type=int, help="override the preset's steps")
    p.add_argument("--failures", help="comma-separated steps after which a rank fails (override)")
    p.add_argument("--interval", type=int, help="N: steps between full checkpoints (override)")
    p.add_argument("--layercheck-warmup", type=int, help="LayerCheck warm-up W (override)")
    p.add_argument("--delta-density", type=float, help="diff: fraction of elements sent per step (override)")
    p.add_argument(
        "--memory-period", type=int, help="layercheck+capture+memory@P: steps between memory versions (override)"
    )
    p.add_argument("--world-size", type=int, help="ranks (override; GPU presets use one GPU per rank)")
    p.add_argument("--zero-stage", type=int, choices=(0, 1, 2, 3), help="DeepSpeed ZeRO stage (override)")
    p.add_argument(
        "--engine",
        choices=BACKENDS,
        default="deepspeed",
        help="the engine every strategy trains on: deepspeed (ZeRO; baselines full, full-async: save_checkpoint) "
        "or fsdp2 (fully_shard; baselines dcp, dcp-async: torch.distributed.checkpoint's save and async_save)",
    )
    p.add_argument("--strategies", help="comma-separated subset (none is always run: it is the reference)")
    p.add_argument("--no-matched", action="store_true", help="skip the matched-freshness runs")
    p.add_argument("--repeats", type=int, default=1, help="run every strategy this many times (times: median)")
    p.add_argument(
        "--store",
        choices=STORES,
        default="local",
        help="where the layer stores go: local disk (under --work-dir) or s3-loopback (an S3-compatible "
        "moto server the benchmark starts on 127.0.0.1; DeepSpeed's own checkpoints stay local): compares "
        "recovery loads from the writers' memory with loads from remote-like storage",
    )
    p.add_argument("--work-dir", type=Path, help="keep checkpoints here (default: a temporary directory)")
    p.add_argument(
        "--out",
        type=Path,
        help=f"write bench.json, summary.md, ettr.json and plots here; while it runs, {PARTIAL} holds the "
        "strategies done so far (a run cut short: --rebuild it)",
    )
    p.add_argument("--json", action="store_true", help="print the JSON report instead of the table")
    p.add_argument(
        "--rebuild",
        type=Path,
        metavar="BENCH_JSON",
        help=f"run nothing: rebuild the report, summary and plots from the measurements in a bench.json "
        f"(or the {PARTIAL} of a run cut short)",
    )
    add_recovery_paths_argument(p)
    add_scale_arguments(p)


def add_recovery_paths_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--recovery-paths",
        type=Path,
        metavar="RECOVERY_JSON",
        help="a `python -m layercheck.bench.recovery_paths` report: the ETTR counts each strategy once per "
        "recovery path (full restart, in place), with that path's restart measured end to end on real Ray "
        "Train runs, instead of the bench's worker imports and engine build",
    )


def add_ettr_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("bench_json", type=Path, help="a `layercheck bench --json` report (or bench.json)")
    p.add_argument("--per-gpu-mtbf-hours", type=float, default=ettr_model.PER_GPU_MTBF_HOURS)
    p.add_argument("--mtbf-hours", default=",".join(f"{h:g}" for h in ettr_model.MTBF_HOURS))
    p.add_argument("--gpus", default=",".join(str(n) for n in ettr_model.GPU_COUNTS))
    p.add_argument("--storage-gbps", type=float, help="storage bandwidth in GB/s (default: as measured)")
    p.add_argument("--restart-s", type=float, help="restart time per failure (default: the measured engine build)")
    add_recovery_paths_argument(p)
    p.add_argument("--runs", type=int, default=200, help="Monte-Carlo runs per point")
    p.add_argument("--strategies", help="comma-separated subset of the report's strategies")
    p.add_argument("--out", type=Path, help="write ettr.json and ettr.png here")
    p.add_argument(
        "--scale",
        type=Path,
        metavar="SCALE_JSON",
        help="a `layercheck bench --scale` report: at each GPU count, LayerCheck's strategies also pay the "
        "measured recovery plan and the control actors' CPU beyond a step (interpolated between its rows, "
        "extrapolated linearly past the last)",
    )
    p.add_argument("--json", action="store_true")


def workload_from_args(args: argparse.Namespace) -> Workload:
    failures = tuple(int(x) for x in args.failures.split(",")) if args.failures else None
    base = preset(
        args.preset,
        steps=args.steps,
        failures=failures,
        interval=args.interval,
        layercheck_warmup=args.layercheck_warmup,
        delta_density=args.delta_density,
        memory_period=getattr(args, "memory_period", None),
        world_size=args.world_size,
        zero_stage=getattr(args, "zero_stage", None),
        engine=getattr(args, "engine", None),
    )
    return variant(base, getattr(args, "workload", "default"))


def run_bench(args: argparse.Namespace) -> int:
    from layercheck.bench.harness import run_benchmark
    from layercheck.bench.machine import describe

    if getattr(args, "scale", False):
        from layercheck.bench.scale.command import run_scale_command

        return run_scale_command(args)
    if args.rebuild:
        previous = json.loads(args.rebuild.read_text())
        report = reports.build_report(previous["raw"], previous["workload"], previous["machine"])
        report = with_measured_restarts(report, args.recovery_paths or previous.get("restart_by_path"))
        if args.out:
            write_outputs(report, args.out)
        print(json.dumps(report, indent=1) if args.json else report_text.text(report))
        return 0
    try:
        workload = workload_from_args(args)
        names = [n.strip() for n in args.strategies.split(",")] if args.strategies else None
        strategies = select(default_strategies(workload.strategy, workload.engine), names, engine=workload.engine)
    except ValueError as error:
        raise SystemExit(f"layercheck bench: {error}") from None
    machine = describe()
    if args.out:  # the results so far, rewritten after each strategy: a run cut short still reports
        args.out.mkdir(parents=True, exist_ok=True)
    raw = run_benchmark(
        workload,
        strategies,
        root=args.work_dir,
        matched=not args.no_matched,
        repeats=args.repeats,
        store=getattr(args, "store", "local"),
        partial=args.out / PARTIAL if args.out else None,
    )
    report = with_measured_restarts(reports.build_report(raw, workload.to_json(), machine), args.recovery_paths)
    if args.out:
        write_outputs(report, args.out)
        (args.out / PARTIAL).unlink(missing_ok=True)  # bench.json has it all
    print(json.dumps(report, indent=1) if args.json else report_text.text(report))
    return 0


def with_measured_restarts(report: dict[str, Any], recovery_paths: Path | dict[str, float] | None) -> dict[str, Any]:
    """``report`` with ``restart_by_path`` (``ettr.restart_by_path``) from a recovery-paths report
    (or as a previous bench.json kept it); unchanged without one."""
    if recovery_paths is None:
        return report
    if isinstance(recovery_paths, Path):
        try:
            recovery_paths = ettr_model.restart_by_path(json.loads(recovery_paths.read_text()))
        except (OSError, ValueError, KeyError, TypeError) as error:
            raise SystemExit(f"layercheck bench: --recovery-paths {recovery_paths}: {error!r}") from None
    return {**report, "restart_by_path": dict(recovery_paths)}


def write_outputs(report: dict[str, Any], out: Path, *, ettr_runs: int = 200) -> None:
    """bench.json, ettr.json, the plots and summary.md into ``out``."""
    from layercheck.bench import plots

    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps(report, indent=1))
    grid = ettr_model.grid(ettr_model.costs_from_bench(report, by_path=report.get("restart_by_path")), runs=ettr_runs)
    (out / "ettr.json").write_text(json.dumps(grid, indent=1))
    names = [
        plots.bytes_vs_staleness(report, out / "bytes_vs_staleness.png").name,
        plots.loss_deviation(report, out / "loss_deviation.png").name,
        plots.ettr_curves(grid, out / "ettr.png").name,
    ]
    (out / "summary.md").write_text(summary.summary_markdown(report, plots=names, ettr=grid))
    logger.info("wrote %s", ", ".join(str(out / n) for n in ("bench.json", "ettr.json", "summary.md", *names)))


def run_ettr(args: argparse.Namespace) -> int:
    try:
        report = json.loads(args.bench_json.read_text())
        if args.recovery_paths and args.restart_s is not None:
            raise ValueError("--restart-s and --recovery-paths both set the restart: give one")
        by_path = (
            ettr_model.restart_by_path(json.loads(args.recovery_paths.read_text())) if args.recovery_paths else None
        )
        costs = ettr_model.costs_from_bench(report, restart_s=args.restart_s, by_path=by_path)
        if args.strategies:
            wanted = {n.strip() for n in args.strategies.split(",")}
            costs = [c for c in costs if c.name.split(" · ")[0] in wanted]
        mtbf = [float(x) for x in args.mtbf_hours.split(",")]
        gpus = [int(x) for x in args.gpus.split(",")]
        scale = scale_costs(json.loads(args.scale.read_text())) if getattr(args, "scale", None) else None
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise SystemExit(f"layercheck ettr: {error!r}") from None
    grid = ettr_model.grid(
        costs,
        mtbf_hours=mtbf,
        gpu_counts=gpus,
        per_gpu_mtbf_hours=args.per_gpu_mtbf_hours,
        runs=args.runs,
        storage_bytes_per_s=args.storage_gbps * 1e9 if args.storage_gbps else None,
        scale=scale,
    )
    if scale is not None:  # what was taken from it, before the table (on stderr under --json)
        base_step_s = min(c.base_step_s for c in costs) if costs else 1.0
        taken = describe_scale(scale, gpus, step_s=base_step_s, source=str(args.scale))
        print(taken, file=sys.stderr if args.json else sys.stdout, end="\n\n")
    if args.out:
        from layercheck.bench import plots

        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "ettr.json").write_text(json.dumps(grid, indent=1))
        plots.ettr_curves(grid, args.out / "ettr.png")
    if args.json:
        json.dump(grid, sys.stdout, indent=1)
        print()
    else:
        print(summary.ettr_table(grid))
    return 0
