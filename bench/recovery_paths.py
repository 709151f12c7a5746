"""A lost worker's recovery, full restart against in place (``cluster.in_place``) and in place
with a warm spare (``cluster.spares = 1``), side by side on the same failure: the demo (``examples/demo.toml``) on a local Ray, rank 1 SIGKILLed after step
``--kill-at``, each path run ``--repeats`` times, interleaved (the machine drifts). For each run:
the time from the failure to the next completed step and its phases (the run summary's
``timeline``), and whether the survivor kept its process. Prints a table and JSON.

    python -m layercheck.bench.recovery_paths --repeats 2 --out bench/results/cpu-in-place/recovery_paths.json
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
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
    return {
        "path": recovery["path"],
        "failure_to_step_s": recovery["failure_to_step_s"],
        "timeline": recovery["timeline"],
        "kept_processes": recovery["kept_processes"],
        "spares_promoted": recovery.get("spares_promoted", 0),
        "resumed_at": recovery["resumed_at"],
    }


def measure(*, repeats: int, steps: int, kill_at: int, overrides: dict[str, Any]) -> dict[str, Any]:
    import ray

    from layercheck.orchestrator.core.run_config import load_run_config
    from layercheck.orchestrator.runtime.cluster import connect

    connect(load_run_config("examples/demo.toml", {**overrides, **PATHS[IN_PLACE_SPARE]}))  # room for the spare
    runs: dict[str, list[dict]] = {path: [] for path in PATHS}
    try:
        with tempfile.TemporaryDirectory(prefix="layercheck-recovery-paths-") as tmp:
            for i in range(repeats):
                for path, options in PATHS.items():
                    name = "".join(c if c.isalnum() else "-" for c in path).replace("---", "-") + str(i)
                    runs[path].append(
                        run_once(Path(tmp), name, path=options, steps=steps, kill_at=kill_at, overrides=overrides)
                    )
                    logger.warning("%s: %.2f s", name, runs[path][-1]["failure_to_step_s"])
    finally:
        ray.shutdown()
    medians = {
        path: {
            "failure_to_step_s": statistics.median(r["failure_to_step_s"] for r in rows),
            **{phase: statistics.median(r["timeline"][phase] for r in rows) for phase in RECOVERY_PHASES},
        }
        for path, rows in runs.items()
    }
    return {
        "machine": machine.describe(),
        "workload": {"config": "examples/demo.toml", "steps": steps, "kill_at": kill_at, "overrides": overrides},
        "repeats": repeats,
        "runs": runs,
        "median": medians,
        "in_place_over_full_restart": medians[IN_PLACE]["failure_to_step_s"]
        / medians["full restart"]["failure_to_step_s"],
        "spare_over_full_restart": medians[IN_PLACE_SPARE]["failure_to_step_s"]
        / medians["full restart"]["failure_to_step_s"],
    }


def table(report: dict[str, Any]) -> str:
    columns = ["failure_to_step_s", *RECOVERY_PHASES]
    rows = [[path, *(round(values[c], 2) for c in columns)] for path, values in report["median"].items()]
    ratios = [f"in place / full restart: {report['in_place_over_full_restart']:.2f}x"]
    if "spare_over_full_restart" in report:  # reports from before the spares have no such path
        ratios.append(f"in place + spare / full restart: {report['spare_over_full_restart']:.2f}x")
    return (
        format_table(["path (median s)", *columns], rows)
        + "\n"
        + "; ".join(ratios)
        + f" (median of {report['repeats']})"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--kill-at", type=int, default=20)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a run-config override")
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    args = parser.parse_args(argv)
    overrides = {}
    for item in args.set:
        key, _, value = item.partition("=")
        try:
            overrides[key] = json.loads(value)
        except json.JSONDecodeError:
            overrides[key] = value
    report = measure(repeats=args.repeats, steps=args.steps, kill_at=args.kill_at, overrides=overrides)
    print(table(report))
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
