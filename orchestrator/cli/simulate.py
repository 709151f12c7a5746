"""``layercheck simulate``: replay a drift trace (recorded or synthetic) through a policy and
print what its knobs trade, against full checkpoints at matched freshness and the offline oracle
(per-layer periods chosen knowing the whole trace) at matched unsaved drift, with the most bytes
each hands over in one step."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

from layercheck.orchestrator.store.layer_store import RUN_CONFIG_FILE
from layercheck.orchestrator.table import format_table, human_bytes
from layercheck.policies.config_loader import ConfigError
from layercheck.policies.configs import POLICY_CONFIGS, LayerCheckConfig, PolicyConfig, policy_config, policy_name
from layercheck.policies.simulation import (
    BYTES_PER_PARAM,
    Comparison,
    OracleMatch,
    compare,
    oracle_at_drift,
    simulate_config,
    sweep_k0,
)
from layercheck.policies.trace import DriftTrace, TraceFormatError, synthetic_trace

logger = logging.getLogger(__name__)


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
    pol = p.add_argument_group(
        "policy (default: the run's own, from run.json beside --trace; else staggered, or layercheck with --sweep)"
    )
    pol.add_argument("--policy", default=None, help=" | ".join(POLICY_CONFIGS))
    pol.add_argument("--k0", type=float, default=None, help="(default 1e-3)")
    pol.add_argument("--k0-embed", type=float, default=None, help="(default 1e-2)")
    pol.add_argument("--smax", type=int, default=None, help="(default 1000)")
    pol.add_argument("--warmup", type=int, default=None, help="warm-up steps W (base checkpoint at W; default 200)")
    pol.add_argument("--schedule", default=None, help="threshold schedule: lr | constant (default lr)")
    pol.add_argument(
        "--interval", type=int, default=None, help="interval policy: steps between full checkpoints (default 100)"
    )
    pol.add_argument(
        "--period",
        type=int,
        default=None,
        help="staggered / drift-optimal: save period of a layer drifting at the mean rate (default 100 / 50)",
    )
    pol.add_argument(
        "--max-bytes-per-step",
        type=int,
        default=None,
        help="staggered: cap on the bytes handed over per step on average",
    )
    pol.add_argument(
        "--spread-phases",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="staggered: the layers' first saves evenly over the first period, not on consecutive steps",
    )
    pol.add_argument("--sweep", help="comma-separated K0 values: print the whole trade-off curve")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if not args.verbose:  # thousands of replayed decisions are not news
        logging.getLogger("layercheck.policies").setLevel(logging.WARNING)
    try:
        trace = load_trace(args)
        config = _policy_config(args)
    except (OSError, TraceFormatError, ConfigError) as exc:
        raise SystemExit(f"layercheck simulate: {exc}") from None
    if args.write_trace:
        text = trace.to_csv() if args.write_trace.suffix == ".csv" else json.dumps(trace.to_json())
        args.write_trace.write_text(text)
    eval_from = getattr(config, "warmup_steps", args.warmup or 0)
    last = max((obs.step for obs in trace.steps), default=0)
    if eval_from > 0 and last < eval_from:  # nothing is persisted before the warm-up: 0 staleness would lie
        raise SystemExit(
            f"layercheck simulate: the trace ends at step {last}, before the policy's warm-up "
            f"(base checkpoint at step {eval_from}): the policy persists nothing on it, so there "
            f"is nothing to measure; pass a smaller --warmup, or a longer trace"
        )
    if args.sweep:
        if not isinstance(config, LayerCheckConfig):  # the sweep varies K0, which only LayerCheck has
            raise SystemExit("layercheck simulate: --sweep needs --policy layercheck")
        values = [float(v) for v in args.sweep.split(",") if v.strip()]
        comparisons = sweep_k0(trace, config, values, eval_from=eval_from)
    elif config.selective:
        comparisons = [compare(trace, config, label=config.describe(), eval_from=eval_from, oracle=True)]
    else:
        result = simulate_config(trace, config, label=policy_name(config), eval_from=eval_from)
        oracle = oracle_at_drift(trace, result.mean_unsaved_drift, warmup_steps=eval_from, eval_from=eval_from)
        if args.json:
            print(json.dumps({**_result_json(result), "oracle": _oracle_json(oracle)}, indent=2))
        else:
            print(_summary([result, _oracle_row(oracle)]))
        return 0
    report = {
        "trace": {"layers": len(trace.layers), "steps": len(trace.steps), "params": sum(trace.numel.values())},
        "eval_from": eval_from,
        "comparisons": [_comparison_json(c) for c in comparisons],
    }
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(_comparison_table(comparisons, full_checkpoint=sum(trace.numel.values()) * BYTES_PER_PARAM))
        if len(comparisons) == 1:
            print()
            print(_per_layer_table(trace, comparisons[0]))
    return 0


def load_trace(args: argparse.Namespace) -> DriftTrace:
    if args.trace is not None:
        return DriftTrace.parse(args.trace.read_text())
    return synthetic_trace(
        blocks=args.blocks,
        steps=args.steps,
        peak_lr=args.peak_lr,
        spread=args.spread,
        seed=args.seed,
        warmup=min(100, args.steps // 10),
    )


_FLAGS = {
    "k0": "k0",
    "k0_embed": "k0_embed",
    "smax": "smax",
    "warmup": "warmup_steps",
    "schedule": "threshold_schedule",
    "interval": "interval",
    "period": "period",
    "max_bytes_per_step": "max_bytes_per_step",
    "spread_phases": "spread_phases",
}


def _policy_config(args: argparse.Namespace) -> PolicyConfig:
    """The policy to replay: the run's own (``run.json`` beside ``--trace``) unless ``--policy``
    names one; flags given override its fields."""
    name: str | None = args.policy
    params: dict[str, Any] = {}
    run_policy = _run_policy(args.trace) if args.trace is not None and name is None else None
    if run_policy is not None:
        name, params = run_policy
        logger.info("replaying the run's own policy from run.json beside the trace: %s %s", name, params)
    name = name or ("layercheck" if args.sweep else "staggered")  # a sweep is of K0
    fields = {f.name for f in dataclasses.fields(POLICY_CONFIGS[name])} if name in POLICY_CONFIGS else set()
    for flag, field in _FLAGS.items():
        value = getattr(args, flag, None)
        if value is not None and field in fields:
            params[field] = value
    return policy_config(name, params)


def _run_policy(trace: Path) -> tuple[str, dict[str, Any]] | None:
    """``(name, params)`` of the policy in the ``run.json`` next to ``trace``, if there is one."""
    path = trace.parent / RUN_CONFIG_FILE
    if not path.is_file():
        return None
    try:
        policy = dict(json.loads(path.read_text())["policy"])
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ConfigError(f"{path}: cannot read the run's policy ({error}); pass --policy") from None
    return str(policy.pop("name")), policy


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
        "peak_step_bytes": r.peak_step_bytes,
        "peak_backlog_bytes": r.peak_backlog_bytes,
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
        **({"oracle": _oracle_json(c.oracle), "bytes_vs_oracle_matched_drift": c.bytes_vs_oracle} if c.oracle else {}),
    }


def _oracle_json(o: OracleMatch) -> dict[str, Any]:
    return {
        "bytes_at_matched_drift": o.bytes_at_target,
        "budget_bytes_per_step": o.budget,
        "result": _result_json(o.result),
    }


def _oracle_row(o: OracleMatch):
    """The oracle's run as a summary row, its bytes those at exactly the matched drift."""
    return dataclasses.replace(o.result, policy="oracle @ same drift", bytes_written=round(o.bytes_at_target))


def _summary(results) -> str:
    return format_table(
        [
            "policy",
            "events",
            "written",
            "peak step",
            "peak backlog",
            "mean w-staleness",
            "max staleness",
            "mean unsaved drift",
            "max unsaved drift",
        ],
        [
            [
                r.policy,
                r.events,
                human_bytes(r.bytes_written),
                human_bytes(r.peak_step_bytes),
                human_bytes(round(r.peak_backlog_bytes)),
                r.mean_weighted_staleness,
                r.max_staleness,
                r.mean_unsaved_drift,
                r.max_unsaved_drift,
            ]
            for r in results
        ],
    )


def _comparison_table(comparisons: list[Comparison], *, full_checkpoint: int) -> str:
    rows = []
    for c in comparisons:
        r = c.result
        rows.append(
            [
                r.policy,
                r.events,
                human_bytes(r.bytes_written),
                human_bytes(r.peak_step_bytes),
                human_bytes(round(r.peak_backlog_bytes)),
                r.mean_weighted_staleness,
                r.max_staleness,
                r.mean_unsaved_drift,
                c.matched_staleness.policy,
                c.bytes_vs_staleness_match,
                c.matched_drift.policy,
                c.bytes_vs_drift_match,
                c.bytes_vs_oracle if c.oracle else "",
            ]
        )
        if c.oracle:
            o = _oracle_row(c.oracle)
            rows.append(
                [
                    f"  {o.policy}",
                    o.events,
                    human_bytes(o.bytes_written),
                    human_bytes(o.peak_step_bytes),
                    human_bytes(round(o.peak_backlog_bytes)),
                    o.mean_weighted_staleness,
                    o.max_staleness,
                    o.mean_unsaved_drift,
                    "",
                    "",
                    "",
                    "",
                    1.0,
                ]
            )
    return format_table(
        [
            "policy",
            "events",
            "written",
            "peak step",
            "peak backlog",
            "mean w-stal",
            "max stal",
            "mean unsaved drift",
            "full @ same stal",
            "bytes ratio",
            "full @ same drift",
            "bytes ratio",
            "vs oracle",
        ],
        rows,
    ) + (
        "\n(bytes ratio = policy bytes / full-checkpoint bytes at matched freshness; < 1 means the policy writes less."
        f"\n vs oracle = policy bytes / the oracle's at the same unsaved drift. Full checkpoints hand over a whole "
        f"checkpoint, {human_bytes(full_checkpoint)}, at each save.\n peak backlog = the most bytes waiting to be "
        "written at once where storage writes the policy's mean bytes per step from its first save on, no faster.)"
    )


def _per_layer_table(trace: DriftTrace, c: Comparison) -> str:
    r = c.result
    return format_table(
        ["layer", "params", "persists", "written"],
        [
            [
                name,
                trace.numel[name],
                r.persists[name],
                human_bytes(r.persists[name] * trace.numel[name] * BYTES_PER_PARAM),
            ]
            for name in trace.layers
        ],
    )
