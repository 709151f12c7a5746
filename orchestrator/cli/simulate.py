"""``layercheck simulate``: replay a drift trace (recorded or synthetic) through a policy and
print what picking ``K0`` and ``Smax`` trades, against full checkpoints at matched freshness."""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path
from typing import Any

from policies.config_loader import ConfigError
from policies.configs import PolicyConfig, policy_config
from policies.simulate import BYTES_PER_PARAM, Comparison, compare, simulate_config, sweep_k0
from policies.trace import DriftTrace, TraceFormatError, synthetic_trace
from orchestrator.table import format_table, human_bytes


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "simulate",
        help="replay a drift trace through a checkpoint policy",
        description=__doc__,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    src = p.add_argument_group("trace (a recorded CSV/JSON trace, else a synthetic one)")
    src.add_argument("--trace", type=Path, help="drift trace file (CSV or JSON; see policies/trace.py)")
    src.add_argument("--steps", type=int, default=2000, help="synthetic: steps")
    src.add_argument("--blocks", type=int, default=24, help="synthetic: transformer blocks")
    src.add_argument("--spread", type=float, default=0.3, help="synthetic: how much block drift rates differ")
    src.add_argument("--peak-lr", type=float, default=1e-5, help="synthetic: peak learning rate")
    src.add_argument("--seed", type=int, default=0, help="synthetic: random seed")
    src.add_argument("--write-trace", type=Path, help="also write the trace used (JSON, or CSV for *.csv)")
    pol = p.add_argument_group("policy")
    pol.add_argument("--policy", default="layercheck", help="layercheck | drift-optimal | interval | never")
    pol.add_argument("--k0", type=float, default=1e-3)
    pol.add_argument("--k0-embed", type=float, default=1e-2)
    pol.add_argument("--smax", type=int, default=1000)
    pol.add_argument("--warmup", type=int, default=200, help="warm-up steps W (base checkpoint at W)")
    pol.add_argument("--schedule", default="lr", help="threshold schedule: lr | constant")
    pol.add_argument("--interval", type=int, default=100, help="interval policy: steps between full checkpoints")
    pol.add_argument("--period", type=int, default=50,
                     help="drift-optimal: save period of a layer drifting at the mean rate")
    pol.add_argument("--sweep", help="comma-separated K0 values: print the whole trade-off curve")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if not args.verbose:  # thousands of replayed decisions are not news
        logging.getLogger("policies").setLevel(logging.WARNING)
    try:
        trace = load_trace(args)
        config = _policy_config(args)
    except (OSError, TraceFormatError, ConfigError) as exc:
        raise SystemExit(f"layercheck simulate: {exc}") from None
    if args.write_trace:
        text = trace.to_csv() if args.write_trace.suffix == ".csv" else json.dumps(trace.to_json())
        args.write_trace.write_text(text)
    eval_from = args.warmup
    if args.sweep:
        if args.policy != "layercheck":  # the sweep varies K0, which only LayerCheck has
            raise SystemExit("layercheck simulate: --sweep needs --policy layercheck")
        values = [float(v) for v in args.sweep.split(",") if v.strip()]
        comparisons = sweep_k0(trace, config, values, eval_from=eval_from)
    elif config.selective:
        comparisons = [compare(trace, config, label=config.describe(), eval_from=eval_from)]
    else:
        result = simulate_config(trace, config, label=config.describe(), eval_from=eval_from)
        print(json.dumps(_result_json(result), indent=2) if args.json else _summary([result]))
        return 0
    report = {
        "trace": {"layers": len(trace.layers), "steps": len(trace.steps), "params": sum(trace.numel.values())},
        "eval_from": eval_from,
        "comparisons": [_comparison_json(c) for c in comparisons],
    }
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(_comparison_table(comparisons))
        if len(comparisons) == 1:
            print()
            print(_per_layer_table(trace, comparisons[0]))
    return 0


def load_trace(args: argparse.Namespace) -> DriftTrace:
    if args.trace is not None:
        return DriftTrace.parse(args.trace.read_text())
    return synthetic_trace(
        blocks=args.blocks, steps=args.steps, peak_lr=args.peak_lr, spread=args.spread, seed=args.seed,
        warmup=min(100, args.steps // 10),
    )


def _policy_config(args: argparse.Namespace) -> PolicyConfig:
    if args.policy == "layercheck":
        return policy_config("layercheck", {
            "k0": args.k0, "k0_embed": args.k0_embed, "smax": args.smax,
            "warmup_steps": args.warmup, "threshold_schedule": args.schedule,
        })
    if args.policy == "interval":
        return policy_config("interval", {"interval": args.interval})
    if args.policy == "drift-optimal":
        return policy_config("drift-optimal", {"period": args.period, "smax": args.smax, "warmup_steps": args.warmup})
    return policy_config(args.policy, {})


def _result_json(r) -> dict[str, Any]:
    return {
        "policy": r.policy,
        "events": r.events,
        "bytes_written": r.bytes_written,
        "bytes_per_event": r.bytes_per_event,
        "mean_weighted_staleness": r.mean_weighted_staleness,
        "max_staleness": r.max_staleness,
        "mean_unsaved_drift": r.mean_unsaved_drift,
        "max_unsaved_drift": r.max_unsaved_drift,
        "persists": r.persists,
        "staleness_series": [list(row) for row in r.staleness_series],
    }


def _comparison_json(c: Comparison) -> dict[str, Any]:
    return {
        "result": _result_json(c.result),
        "matched_staleness": _result_json(c.matched_staleness),
        "matched_drift": _result_json(c.matched_drift),
        "bytes_vs_full_matched_staleness": c.bytes_vs_staleness_match,
        "bytes_vs_full_matched_drift": c.bytes_vs_drift_match,
    }


def _summary(results) -> str:
    return format_table(
        ["policy", "events", "written", "mean w-staleness", "max staleness", "mean unsaved drift", "max unsaved drift"],
        [[r.policy, r.events, human_bytes(r.bytes_written), r.mean_weighted_staleness, r.max_staleness,
          r.mean_unsaved_drift, r.max_unsaved_drift] for r in results],
    )


def _comparison_table(comparisons: list[Comparison]) -> str:
    rows = []
    for c in comparisons:
        r = c.result
        rows.append([
            r.policy, r.events, human_bytes(r.bytes_written), r.mean_weighted_staleness, r.max_staleness,
            r.mean_unsaved_drift,
            c.matched_staleness.policy, c.bytes_vs_staleness_match,
            c.matched_drift.policy, c.bytes_vs_drift_match,
        ])
    return format_table(
        ["policy", "events", "written", "mean w-stal", "max stal", "mean unsaved drift",
         "full @ same stal", "bytes ratio", "full @ same drift", "bytes ratio"],
        rows,
    ) + "\n(bytes ratio = policy bytes / full-checkpoint bytes at matched freshness; < 1 means the policy writes less)"


def _per_layer_table(trace: DriftTrace, c: Comparison) -> str:
    r = c.result
    return format_table(
        ["layer", "params", "persists", "written"],
        [[name, trace.numel[name], r.persists[name], human_bytes(r.persists[name] * trace.numel[name] * BYTES_PER_PARAM)]
         for name in trace.layers],
    )
