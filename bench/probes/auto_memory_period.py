"""``persistence.memory_period = "auto"`` (the default) against ``0`` on examples/hf_trainer_sft.py.

    python bench/probes/auto_memory_period.py --out bench/results/cpu-auto-memory-period

Runs the example as a user runs it (TRL's SFTTrainer with DeepSpeed on 2 Ray Train CPU workers,
LayerCheck added by its callback), one run at a time (each is CPU-heavy), for each setting: a
failure-free run, a run whose rank 1 is SIGKILLed early (``--early``: while the run still takes a
memory version every step, before its period is chosen) and one SIGKILLed late (``--late``: at
the chosen period). Each failed run is compared with the failure-free run of its setting: the loss
deviation after the recovery (``|loss - failure-free loss|`` over the steps after ``t_fail``), the
staleness of what the recovery loaded and what the summary says of the period. The failure-free
pair gives the step-time cost: the mean step (compute and LayerCheck's stall on the training
thread) and the stall alone, per step. Prints a table (``--json``: the JSON); with ``--out``
writes ``results.json``, ``table.txt`` and each run's result JSON (its losses and summary) under
``runs/``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from layercheck.orchestrator.table import format_table

ROOT = Path(__file__).resolve().parents[2]
SETTINGS = ("auto", "0")


def run_example(name: str, args: list[str], work: Path, runs: Path | None) -> dict[str, Any]:
    """One run of the example (its own local Ray); its result JSON, with the wall time and the load."""
    out = work / f"{name}.json"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p), DS_ACCELERATOR="cpu")
    command = [sys.executable, "examples/hf_trainer_sft.py", "--storage", str(work / name), "--result-json", str(out)]
    load_before, started = os.getloadavg()[0], time.monotonic()
    proc = subprocess.run([*command, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"{name} failed: {proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    result = json.loads(out.read_text())
    result["bench"] = {
        "args": args,
        "wall_s": time.monotonic() - started,
        "load_1min_before": load_before,
        "load_1min_after": os.getloadavg()[0],
    }
    if runs is not None:
        (runs / f"{name}.json").write_text(json.dumps(result, indent=1, default=str))
    print(f"{name}: {result['bench']['wall_s']:.0f}s", file=sys.stderr, flush=True)
    return result


def losses(result: dict[str, Any]) -> dict[int, float]:
    return {int(step): float(loss) for step, loss in result["losses"].items()}


def deviation(failed: dict[str, Any], clean: dict[str, Any], t_fail: int) -> dict[str, float]:
    """The loss deviation over the steps after ``t_fail``: absolute and relative, mean and max."""
    mine, ref = losses(failed), losses(clean)
    after = [s for s in sorted(ref) if s > t_fail and s in mine]
    absolute = [abs(mine[s] - ref[s]) for s in after]
    relative = [abs(mine[s] - ref[s]) / abs(ref[s]) for s in after]
    return {
        "steps": len(after),
        "abs_mean": statistics.fmean(absolute),
        "abs_max": max(absolute),
        "rel_mean": statistics.fmean(relative),
        "rel_max": max(relative),
        "worst_step": after[max(range(len(after)), key=absolute.__getitem__)],
    }


def stale(recovery: dict[str, Any]) -> dict[str, Any]:
    """What the recovery brought back from before ``t_fail``: elements, share, mean and max steps stale."""
    t_fail = recovery["t_fail"]
    sources = [s for layer in recovery["sources"].values() for s in layer if s["elements"]]
    old = [(s["elements"], t_fail - s["step"]) for s in sources if s["step"] < t_fail]
    total, count = sum(s["elements"] for s in sources), sum(n for n, _ in old)
    return {
        "elements": total,
        "stale_elements": count,
        "stale_share": count / total if total else 0.0,
        "mean_steps_stale": sum(n * age for n, age in old) / count if count else 0.0,
        "max_steps_stale": max((age for _, age in old), default=0),
        "origins": sorted({f"{s['origin']}@{s['step']}" for s in sources}),
    }


def failure_figures(failed: dict[str, Any], clean: dict[str, Any]) -> dict[str, Any]:
    summary = failed["summary"]
    (recovery,) = [r for r in summary["recoveries"] if r.get("kind", "failure") != "resume"]
    checks = summary.get("memory_period_checks") or []
    return {
        "t_fail": recovery["t_fail"],
        "loss_deviation": deviation(failed, clean, recovery["t_fail"]),
        "recovered": stale(recovery),
        "recovered_elements": summary.get("recovered_elements"),
        "memory_period": summary.get("memory_period_choice"),
        "period_check": checks[0] if checks else None,
    }


def cost_figures(clean: dict[str, Any]) -> dict[str, Any]:
    summary = clean["summary"]
    steps = summary["steps"]
    return {
        "step_s_mean": summary["step_s_per_step"]["mean"],
        "step_s_p90": summary["step_s_per_step"]["p90"],
        "stall_s_per_step": summary["stall_s"] / steps,
        "memory_period": summary.get("memory_period_choice"),
        "wall_s": clean["bench"]["wall_s"],
        "load_1min": [clean["bench"]["load_1min_before"], clean["bench"]["load_1min_after"]],
    }


def measure(args: argparse.Namespace) -> dict[str, Any]:
    runs_dir = None
    if args.out is not None:
        runs_dir = args.out / "runs"
        runs_dir.mkdir(parents=True, exist_ok=True)
    common = ["--steps", str(args.steps), *args.example_args]
    results: dict[str, Any] = {"settings": {}}
    with tempfile.TemporaryDirectory(prefix="auto-memory-period-") as work:
        for setting in SETTINGS:
            period = ["--memory-period", setting]
            clean = run_example(f"clean-{setting}", [*common, *period, "--kill-at-step", "0"], Path(work), runs_dir)
            figures: dict[str, Any] = {"clean": cost_figures(clean)}
            for when, step in (("early", args.early), ("late", args.late)):
                failed = run_example(
                    f"{when}-{setting}", [*common, *period, "--kill-at-step", str(step)], Path(work), runs_dir
                )
                figures[when] = failure_figures(failed, clean)
            figures["clean_losses"] = losses(clean)
            results["settings"][setting] = figures
    auto, off = results["settings"]["auto"], results["settings"]["0"]
    results["clean_losses_equal"] = auto.pop("clean_losses") == off.pop("clean_losses")
    results["step_cost"] = {
        "step_s": auto["clean"]["step_s_mean"] / off["clean"]["step_s_mean"] - 1,
        "stall_s_per_step": auto["clean"]["stall_s_per_step"] - off["clean"]["stall_s_per_step"],
        "stall_share_of_step": (auto["clean"]["stall_s_per_step"] - off["clean"]["stall_s_per_step"])
        / off["clean"]["step_s_mean"],
    }
    results["setup"] = {
        "command": f"python bench/probes/auto_memory_period.py --steps {args.steps} --early {args.early} --late {args.late}",
        "example_args": common,
        "date": time.strftime("%Y-%m-%d"),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "processor": _cpu_model()},
    }
    return results


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def table(results: dict[str, Any]) -> str:
    rows = []
    for setting, figures in results["settings"].items():
        for when in ("early", "late"):
            f = figures[when]
            dev, rec = f["loss_deviation"], f["recovered"]
            period = f["memory_period"] or {}
            in_force = (
                period.get("start")
                if period.get("chosen_at") is None or f["t_fail"] <= period["chosen_at"]
                else period.get("period")
            )
            check = f["period_check"]
            rows.append(
                [
                    setting,
                    f"{when} (t_fail {f['t_fail']})",
                    in_force,
                    f"{rec['stale_share']:.0%} ({rec['mean_steps_stale']:.1f} steps, max {rec['max_steps_stale']})",
                    f"{dev['abs_mean']:.4f} / {dev['abs_max']:.4f}",
                    f"{dev['rel_max']:.2%} (step {dev['worst_step']})",
                    "-" if check is None else ("kept" if check["kept"] else "NOT KEPT"),
                ]
            )
    failures = format_table(
        [
            "memory_period",
            "failure",
            "P in force",
            "lost slices stale (mean, max)",
            "|dloss| mean / max",
            "max rel dloss",
            "period check",
        ],
        rows,
    )
    costs = format_table(
        ["memory_period", "P chosen and why", "step mean / p90", "stall per step"],
        [
            [
                setting,
                (figures["clean"]["memory_period"] or {}).get("why", "-"),
                f"{figures['clean']['step_s_mean'] * 1e3:.1f} / {figures['clean']['step_s_p90'] * 1e3:.1f} ms",
                f"{figures['clean']['stall_s_per_step'] * 1e3:.2f} ms",
            ]
            for setting, figures in results["settings"].items()
        ],
    )
    cost = results["step_cost"]
    return (
        f"{failures}\n\n{costs}\n\nstep-time cost of auto against 0: {cost['step_s']:+.2%} of the mean step; "
        f"stall {cost['stall_s_per_step'] * 1e3:+.2f} ms a step ({cost['stall_share_of_step']:+.2%} of the step); "
        f"failure-free losses equal: {results['clean_losses_equal']}\n"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python bench/probes/auto_memory_period.py", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--early", type=int, default=3, help="the early failure: rank 1 SIGKILLed after this step")
    parser.add_argument("--late", type=int, default=18, help="the late failure")
    parser.add_argument("--out", type=Path, help="write results.json, table.txt and runs/ here")
    parser.add_argument("--json", action="store_true", help="print the JSON instead of the table")
    parser.add_argument("example_args", nargs="*", help="more arguments for the example (after --)")
    args = parser.parse_args(argv)
    results = measure(args)
    text = table(results)
    if args.out is not None:
        (args.out / "results.json").write_text(json.dumps(results, indent=1, default=str))
        (args.out / "table.txt").write_text(text)
    print(json.dumps(results, indent=1, default=str) if args.json else text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
