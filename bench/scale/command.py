"""``layercheck bench --scale``'s arguments and what it runs (``bench/cli.py`` hands over to it)::

layercheck bench --scale --ranks 8,64,256,1024 --out DIR
layercheck bench --scale --ranks 8 --plan-versions 100000 --model llama3.1-70b --scale-factor 10000
layercheck bench --scale --ranks 64 --writer-dies-after 9
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
from pathlib import Path

from layercheck.bench.scale.shapes import SHAPES


def add_scale_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--scale",
        action="store_true",
        help="run the scale harness instead: the control plane and the store under N simulated ranks "
        "(bench/scale/), writing DIR/scale.json with --out",
    )
    p.add_argument("--ranks", default="8,64,256,1024", help="--scale: comma-separated rank counts N")
    p.add_argument("--model", choices=sorted(SHAPES), default="qwen2.5-7b", help="--scale: the layer table")
    p.add_argument("--scale-factor", type=int, default=1000, help="--scale: layer bytes divided by this")
    p.add_argument("--nodes", type=int, default=4, help="--scale: worker nodes of the local Ray cluster")
    p.add_argument("--step-s", type=float, default=1.0, help="--scale: the simulated step time")
    p.add_argument(
        "--profile",
        action="store_true",
        help="--scale: record the control actors and a writer with py-spy (the window, the recovery): "
        "the functions that held the CPU most go in each row's cpu_top",
    )
    p.add_argument(
        "--writer-dies-after",
        type=int,
        default=None,
        metavar="STEP",
        help="--scale: kill the first node's writer actor after this step of the measured window "
        "(with what its ranks handed it unwritten); each row's faults says how the run took it",
    )
    p.add_argument(
        "--plan-versions",
        default="",
        help="--scale: comma-separated history lengths to time the recovery plan over (e.g. 100000)",
    )


def run_scale_command(args: argparse.Namespace) -> int:
    from layercheck.bench.scale.harness import ScaleConfig  # (Ray and the runtime: only when it runs)
    from layercheck.bench.scale.report import run_ranks, table

    try:
        ranks = [int(x) for x in args.ranks.split(",") if x.strip()]
        plan_versions = [int(x) for x in args.plan_versions.split(",") if x.strip()]
        steps = args.steps or ScaleConfig.steps
        base = ScaleConfig(
            ranks=max(2, min(ranks or [2])),
            shape=args.model,
            scale=args.scale_factor,
            nodes=args.nodes,
            steps=steps,
            fail_after=min(ScaleConfig.fail_after or steps - 1, steps - 1),
            step_s=args.step_s,
            writer_dies_after=args.writer_dies_after,
        )
        work_dir = args.work_dir or Path(tempfile.mkdtemp(prefix="lcscale-work-"))
        if args.profile:
            base = dataclasses.replace(base, profile_dir=str(work_dir / "profiles"))
    except ValueError as error:
        raise SystemExit(f"layercheck bench --scale: {error}") from None
    report = run_ranks(ranks, base, work_dir=work_dir, out=args.out, plan_versions=plan_versions)
    print(json.dumps(report, indent=1) if args.json else table(report))
    return 1 if report["stopped"] else 0
