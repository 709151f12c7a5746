"""A lost worker's recovery, full restart against in place (``cluster.in_place``) and in place
with a warm spare (``cluster.spares = 1``), side by side on the same failure, rank 1 SIGKILLed after
step ``--kill-at``, each path run ``--repeats`` times, interleaved (the machine drifts). The
workload: the built-in loop's demo (``examples/demo.toml``) on a local Ray, or one of the examples a
user runs as a script, each with its own local Ray: their own loop with ``layercheck.attach``
(``examples/own_loop.py``) or TRL's ``SFTTrainer`` with the callback (``examples/hf_trainer_sft.py``).
For each run: the time from the failure to the next completed step, that less the step itself (what
the recovery cost), the phases of the run summary's ``timeline`` (each the slowest rank's) and each
rank's own (the survivor's, the replacement's or the promoted spare's). Prints tables and JSON.

    python -m layercheck.bench.recovery_paths --repeats 2 --out bench/results/cpu-in-place/recovery_paths.json
    python -m layercheck.bench.recovery_paths --workload own-loop --repeats 2 --out bench/results/cpu-user-loops/own_loop.json
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from layercheck.bench import machine
from layercheck.bench.ettr import IN_PLACE, IN_PLACE_SPARE
from layercheck.orchestrator.core.accounting import RECOVERY_PHASES
from layercheck.orchestrator.table import format_table

logger = logging.getLogger(__name__)

#: Each path's run-config overrides.
PATHS: dict[str, dict[str, Any]] = {
    "full restart": {"cluster.in_place": False},
    IN_PLACE: {"cluster.in_place": True},
    IN_PLACE_SPARE: {"cluster.in_place": True, "cluster.spares": 1},
}
#: Each path's flags of an example script.
EXAMPLE_FLAGS: dict[str, tuple[str, ...]] = {
    "full restart": (),
    IN_PLACE: ("--in-place",),
    IN_PLACE_SPARE: ("--in-place", "--spares", "1"),
}
#: The workloads: the built-in loop's demo, and the examples a user runs (script, steps, kill-at).
EXAMPLES: dict[str, tuple[str, int, int]] = {
    "own-loop": ("examples/own_loop.py", 30, 20),
    "hf-sft": ("examples/hf_trainer_sft.py", 24, 16),
}
WORKLOADS = ("demo", *EXAMPLES)
#: How a rank of a recovering group got there (``Recovery.ranks``): kept its process, a promoted
#: warm spare, or a new process (under a full restart, every rank).
RANK_KINDS = ("survivor", "spare", "new process")
RANK_PHASES = ("leave_s", "start_s", "waited_s", "group_s", "build_s", "load_s")
#: The checkout the example scripts are in (they run from it, as its README shows).
ROOT = Path(__file__).resolve().parents[1]
#: What ``ray.init`` raises when its local node did not come up in time (a machine overloaded by
#: others): nothing ran yet, so the run is made again, up to ``RAY_START_TRIES`` times in all.
RAY_START_TIMEOUT = "The current node timed out during startup"
RAY_START_TRIES = 3


def run_once(
    root: Path, name: str, *, path: dict[str, Any], steps: int, kill_at: int, overrides: dict[str, Any]
) -> dict:
    """One demo run with rank 1 killed after ``kill_at``; its recovery as the summary has it."""
    from layercheck.orchestrator.core.run_config import load_run_config
    from layercheck.orchestrator.runtime.driver import train

    config = load_run_config(
        "examples/demo.toml",
        {
            "name": name,
            "storage": str(root / name),
            "steps": steps,
            "optim.total_steps": steps,
            "metrics.port": 0,
            "fault.kill_at_step": kill_at,
            **path,
            **overrides,
        },
    )
    result = train(config)
    if result.error is not None:
        raise RuntimeError(f"{name}: {result.error}")
    (recovery,) = result.status["account"]["recoveries"]
    return _record(recovery)


def run_example(
    root: Path, name: str, *, script: str, flags: tuple[str, ...], steps: int, kill_at: int, extra: tuple[str, ...]
) -> dict:
    """One run of an example script, as a user runs it (a process with its own local Ray), rank 1
    killed after ``kill_at``; its recovery as the summary has it."""
    out = root / f"{name}.json"
    command = [
        sys.executable,
        script,
        "--steps",
        str(steps),
        "--kill-at-step",
        str(kill_at),
        "--storage",
        str(root / name),
        "--result-json",
        str(out),
        *flags,
        *extra,
    ]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # its own local Ray
    env.setdefault("DS_ACCELERATOR", "cpu")
    for _ in range(RAY_START_TRIES):
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
        if done.returncode == 0 or RAY_START_TIMEOUT not in done.stderr:
            break
        logger.warning("%s: its local Ray did not start (an overloaded machine): run again", name)
    if done.returncode != 0:
        raise RuntimeError(f"{name}: {' '.join(command)} failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    (recovery,) = json.loads(out.read_text())["summary"]["recoveries"]
    return _record(recovery)


def _record(recovery: dict[str, Any]) -> dict[str, Any]:
    """What the benchmark keeps of a run summary's recovery: the total, that less the first step
    (``recovery_s``: what the recovery cost beside a step), the timeline and each rank's phases."""
    return {
        "path": recovery["path"],
        "failure_to_step_s": recovery["failure_to_step_s"],
        "recovery_s": recovery["failure_to_step_s"] - recovery["timeline"]["first_step"],
        "timeline": recovery["timeline"],
        "kept_processes": recovery["kept_processes"],
        "spares_promoted": recovery.get("spares_promoted", 0),
        "resumed_at": recovery["resumed_at"],
        "ranks": recovery.get("ranks", []),
    }


def rank_kind(rank: dict[str, Any]) -> str:
    """One of :data:`RANK_KINDS` for a rank of ``Recovery.ranks``."""
    return "spare" if rank.get("spare") else "survivor" if rank.get("kept_process") else "new process"


def rank_medians(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per kind of rank (:data:`RANK_KINDS`) that the runs of one path had, the median of each of
    its phases over the runs (the slowest such rank of each run)."""
    out = {}
    for kind in RANK_KINDS:
        per_run = [[r for r in row["ranks"] if rank_kind(r) == kind] for row in rows]
        per_run = [ranks for ranks in per_run if ranks]
        if per_run:
            out[kind] = {
                phase: statistics.median(max(r.get(phase, 0.0) for r in ranks) for ranks in per_run)
                for phase in RANK_PHASES
            }
    return out


def measure(
    *,
    repeats: int,
    steps: int,
    kill_at: int,
    overrides: dict[str, Any],
    workload: str = "demo",
    example_args: tuple[str, ...] = (),
) -> dict[str, Any]:
    """Every path ``repeats`` times, interleaved, on ``workload`` (one of :data:`WORKLOADS`)."""
    described_machine = machine.describe()  # (its load average: before the runs)
    runs: dict[str, list[dict]] = {path: [] for path in PATHS}
    with tempfile.TemporaryDirectory(prefix="layercheck-recovery-paths-") as tmp:
        if workload == "demo":
            _measure_demo(Path(tmp), runs, repeats=repeats, steps=steps, kill_at=kill_at, overrides=overrides)
        else:
            script = EXAMPLES[workload][0]
            for i in range(repeats):
                for path in PATHS:
                    name = _run_name(path, i)
                    runs[path].append(
                        run_example(
                            Path(tmp),
                            name,
                            script=script,
                            flags=EXAMPLE_FLAGS[path],
                            steps=steps,
                            kill_at=kill_at,
                            extra=example_args,
                        )
                    )
                    logger.warning("%s: %.2f s", name, runs[path][-1]["failure_to_step_s"])
    medians = {
        path: {
            "failure_to_step_s": statistics.median(r["failure_to_step_s"] for r in rows),
            "recovery_s": statistics.median(r["recovery_s"] for r in rows),
            **{phase: statistics.median(r["timeline"][phase] for r in rows) for phase in RECOVERY_PHASES},
        }
        for path, rows in runs.items()
    }
    described = (
        {"config": "examples/demo.toml", "overrides": overrides}
        if workload == "demo"
        else {"script": EXAMPLES[workload][0], "args": list(example_args)}
    )
    full = medians["full restart"]
    return {
        "machine": described_machine,
        "workload": {"name": workload, **described, "steps": steps, "kill_at": kill_at},
        "repeats": repeats,
        "runs": runs,
        "median": medians,
        "ranks": {path: rank_medians(rows) for path, rows in runs.items()},
        "in_place_over_full_restart": medians[IN_PLACE]["failure_to_step_s"] / full["failure_to_step_s"],
        "spare_over_full_restart": medians[IN_PLACE_SPARE]["failure_to_step_s"] / full["failure_to_step_s"],
        # the measure: the failure to the next step less that step's own time
        "spare_over_full_restart_less_step": medians[IN_PLACE_SPARE]["recovery_s"] / full["recovery_s"],
    }


def _run_name(path: str, i: int) -> str:
    return "".join(c if c.isalnum() else "-" for c in path).replace("---", "-") + str(i)


def _measure_demo(
    root: Path, runs: dict[str, list[dict]], *, repeats: int, steps: int, kill_at: int, overrides: dict[str, Any]
) -> None:
    import ray

    from layercheck.orchestrator.core.run_config import load_run_config
    from layercheck.orchestrator.runtime.cluster import connect

    connect(load_run_config("examples/demo.toml", {**overrides, **PATHS[IN_PLACE_SPARE]}))  # room for the spare
    try:
        for i in range(repeats):
            for path, options in PATHS.items():
                name = _run_name(path, i)
                runs[path].append(run_once(root, name, path=options, steps=steps, kill_at=kill_at, overrides=overrides))
                logger.warning("%s: %.2f s", name, runs[path][-1]["failure_to_step_s"])
    finally:
        ray.shutdown()


def table(report: dict[str, Any]) -> str:
    columns = ["failure_to_step_s", *RECOVERY_PHASES]
    rows = [[path, *(round(values[c], 2) for c in columns)] for path, values in report["median"].items()]
    ratios = [f"in place / full restart: {report['in_place_over_full_restart']:.2f}x"]
    if "spare_over_full_restart" in report:  # reports from before the spares have no such path
        ratios.append(f"in place + spare / full restart: {report['spare_over_full_restart']:.2f}x")
    if "spare_over_full_restart_less_step" in report:  # (from before the runs kept it: none)
        ratios.append(f"less the first step: {report['spare_over_full_restart_less_step']:.2f}x")
    return (
        format_table(["path (median s)", *columns], rows)
        + "\n"
        + "; ".join(ratios)
        + f" (median of {report['repeats']})"
    )


def rank_table(report: dict[str, Any]) -> str:
    """Each kind of rank's own phases, per path (the survivor's rerun beside the replacement's)."""
    rows = [
        [path, kind, *(round(phases[p], 2) for p in RANK_PHASES)]
        for path, kinds in report.get("ranks", {}).items()
        for kind, phases in kinds.items()
    ]
    return format_table(["path", "rank (median s)", *RANK_PHASES], rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--workload", choices=WORKLOADS, default="demo")
    parser.add_argument("--steps", type=int, help="default: the demo 30, own-loop 30, hf-sft 24")
    parser.add_argument("--kill-at", type=int, help="default: the demo 20, own-loop 20, hf-sft 16")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a run-config override (demo)")
    parser.add_argument(
        "--example-args", default="", help="more arguments for the example script, e.g. '--zero-stage 3'"
    )
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    args = parser.parse_args(argv)
    steps, kill_at = EXAMPLES[args.workload][1:] if args.workload in EXAMPLES else (30, 20)
    overrides = {}
    for item in args.set:
        key, _, value = item.partition("=")
        try:
            overrides[key] = json.loads(value)
        except json.JSONDecodeError:
            overrides[key] = value
    report = measure(
        repeats=args.repeats,
        steps=args.steps or steps,
        kill_at=args.kill_at or kill_at,
        overrides=overrides,
        workload=args.workload,
        example_args=tuple(shlex.split(args.example_args)),
    )
    print(table(report))
    print(rank_table(report))
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
