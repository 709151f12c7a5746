"""The schedule's figures in the benchmark report: peak bytes handed over in one step for every
strategy, and each layer-wise policy's bytes at its own mean unsaved drift against full
checkpoints and against the offline oracle (:func:`layercheck.policies.simulation.oracle_at_drift`).

Units. Layer-wise strategies hand over layer state: fp32 weights and both Adam moments, 12 bytes
a parameter (``handed_state_bytes`` in the raw results, all ranks). A full checkpoint counts
what DeepSpeed's ``save_checkpoint`` holds: every trainable parameter's state (12 bytes) and
the frozen parameters' weights (4 bytes, fp32; they have no optimizer state). The oracle plans in
the same 12-byte unit over the same drift trace (the ``none`` run's), so the two ratios compare
like with like. The DeepSpeed baselines' peak is their measured checkpoint size (files of one
save, all ranks): what they hand over at once.

Pure: dicts in, dicts and strings out.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from layercheck.bench.formulas import checkpoints_in, matched_intervals
from layercheck.orchestrator.table import format_table, human_bytes
from layercheck.policies.staggered import BYTES_PER_PARAM

FROZEN_BYTES_PER_PARAM = 4
"""A frozen parameter in a full checkpoint: its fp32 weight, no moments."""

LAYER_KINDS = ("layer-interval", "layer-policy", "differential")
ENGINE_SAVE_KINDS = ("deepspeed-sync", "deepspeed-async", "dcp-sync", "dcp-async")
"""The engines' own full checkpoints (DeepSpeed's, and DCP's under FSDP2): their peak is one save's files."""


def full_checkpoint_bytes(params: int, frozen_params: int) -> int:
    """One full checkpoint's state bytes: trainable state plus frozen weights."""
    return params * BYTES_PER_PARAM + frozen_params * FROZEN_BYTES_PER_PARAM


def peak_step_bytes(row: Mapping[str, Any], raw: Mapping[str, Any]) -> float | None:
    """The most bytes one strategy handed over at one step (``None``: not measured in ``raw``).
    ``diff``: its full saves (its per-step deltas, ~density of the state, come on top)."""
    if row["kind"] == "none":
        return 0.0
    if row["kind"] in ENGINE_SAVE_KINDS:
        return row["bytes_per_event"]
    handed = raw.get("handed_state_bytes")
    return float(handed["peak_step"]) if handed else None


def add_peak_bytes(rows: dict[str, dict[str, Any]], results: Mapping[str, Any], *, full_bytes: int) -> None:
    for name, row in rows.items():
        peak = peak_step_bytes(row, results[name])
        row["peak_step_bytes"] = peak
        row["peak_fraction_of_full"] = peak / full_bytes if peak is not None and full_bytes else None


def add_drift_matched(
    rows: dict[str, dict[str, Any]],
    results: Mapping[str, Any],
    *,
    params: int,
    frozen_params: int,
    steps: int,
    eval_from: int,
) -> None:
    """Per layer-wise policy row, ``at_matched_drift``: its handed state bytes, full checkpoints'
    bytes at the interval matching its mean unsaved drift (from step W on), the oracle's bytes at
    the same drift, and the two ratios."""
    from layercheck.policies.simulation import oracle_at_drift
    from layercheck.policies.trace import DriftTrace

    if "trace" not in results.get("none", {}):
        return
    trace = DriftTrace.from_json(results["none"]["trace"])
    full = full_checkpoint_bytes(params, frozen_params)
    for name, row in rows.items():
        handed = results[name].get("handed_state_bytes")
        if row["kind"] != "layer-policy" or not handed:
            continue
        target = row["mean_unsaved_drift"]
        interval = matched_intervals(
            trace, target_staleness=row["mean_weighted_staleness"], target_drift=target, eval_from=eval_from
        ).drift
        full_bytes = full * checkpoints_in(interval, eval_from, steps)
        oracle = oracle_at_drift(trace, target, warmup_steps=eval_from, eval_from=eval_from)
        row["at_matched_drift"] = {
            "state_bytes": handed["total"],
            "full_checkpoint_bytes": full,
            "full_interval": interval,
            "full_bytes": full_bytes,
            "oracle_bytes": oracle.bytes_at_target,
            "oracle_budget_per_step": oracle.budget,
            "vs_full": _ratio(handed["total"], full_bytes),
            "vs_oracle": _ratio(handed["total"], oracle.bytes_at_target),
        }


def headline(rows: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    at = {n: r["at_matched_drift"] for n, r in rows.items() if "at_matched_drift" in r}
    return {
        "peak_step_bytes": {n: r.get("peak_step_bytes") for n, r in rows.items()},
        "peak_fraction_of_full": {n: r.get("peak_fraction_of_full") for n, r in rows.items()},
        "state_bytes_vs_full_at_own_matched_drift": {n: a["vs_full"] for n, a in at.items()},
        "state_bytes_vs_oracle_at_own_matched_drift": {n: a["vs_oracle"] for n, a in at.items()},
    }


def drift_table(report: Mapping[str, Any]) -> str:
    """The layer-wise policies at their own mean unsaved drift: bytes vs full and vs the oracle,
    and the peak per step."""
    rows = []
    for name, r in report["strategies"].items():
        a = r.get("at_matched_drift")
        if not a:
            continue
        rows.append(
            [
                name,
                f"{r['mean_unsaved_drift']:.3g}",
                human_bytes(a["state_bytes"]),
                a["full_interval"],
                human_bytes(a["full_bytes"]),
                human_bytes(a["oracle_bytes"]),
                f"{a['vs_full']:.2f}x",
                f"{a['vs_oracle']:.2f}x",
                _bytes(r.get("peak_step_bytes")),
                _fraction(r.get("peak_fraction_of_full")),
            ]
        )
    return format_table(
        [
            "strategy",
            "unsaved drift",
            "state bytes",
            "full N",
            "full bytes",
            "oracle bytes",
            "vs full",
            "vs oracle",
            "peak/step",
            "peak/full",
        ],
        rows,
    )


def _bytes(value: float | None) -> str:
    return "-" if value is None else human_bytes(value)


def _fraction(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _ratio(a: float, b: float) -> float:
    return a / b if b else float("inf")
