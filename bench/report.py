"""From the ranks' raw measurements to the benchmark report: one row per strategy, the
matched-freshness pairs and the headline (its text forms: :mod:`layercheck.bench.report_text`).

Pure: dicts in, dicts and strings out. Every figure in a summary or the README comes from here.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from layercheck.bench import dcp_report, recovery_report, schedule_report
from layercheck.bench.formulas import (
    checkpoints_in,
    loss_deviation,
    matched_intervals,
    measured_ettr,
    post_failure_windows,
)


def _mean(values: Sequence[float]) -> float:
    return statistics.fmean(values) if values else 0.0


def _losses(raw: Mapping[str, Any]) -> dict[int, float]:
    return {int(k): float(v) for k, v in raw["losses"].items()}


def strategy_row(
    raw: Mapping[str, Any], none: Mapping[str, Any], *, steps: int, failures: Sequence[int], restart_s: float
) -> dict[str, Any]:
    """The reported figures of one strategy (``none``'s failures are modelled: restart at step 0)."""
    s = raw["strategy"]
    reference = _losses(none)
    none_step = none["train_s"] / steps
    recoveries = list(raw["recoveries"])
    if s["kind"] == "none":  # not run with failures: every step before the failure is re-run
        recoveries = [
            {
                "t_fail": f,
                "steps_lost": f,
                "plan_s": 0.0,
                "load_s": 0.0,
                "replay_s": f * none_step,
                "recovery_s": f * none_step,
                "weighted_staleness": float(f),
                "max_staleness": f,
                "modelled": True,
            }
            for f in failures
        ]
    deviation = loss_deviation(_losses(raw), reference, post_failure_windows(failures, steps))
    recovery_total = sum(r["recovery_s"] for r in recoveries)
    plan_load = _mean([r["plan_s"] + r["load_s"] for r in recoveries])
    # a rollback's re-run steps are in its replay time; ETTR models them from steps lost instead
    delta_replay = _mean([r["replay_s"] for r in recoveries]) if s["recovery"] == "replay-deltas" else 0.0
    events = raw["events"]
    critical = raw["stall_s"] + (raw["probe_s"] if s["kind"] == "layer-policy" else 0.0)
    return {
        "name": s["name"],
        "kind": s["kind"],
        "recovery": s["recovery"],
        "interval": s["interval"],
        "matched": s["matched"],
        "train_s": raw["train_s"],
        "step_s": raw["train_s"] / steps,
        # the critical-path cost measured directly: stalls, plus the probe LayerCheck needs
        "critical_s": critical,
        "overhead": critical / none["train_s"],
        "wall_overhead": raw["train_s"] / none["train_s"] - 1.0,
        "compute_slowdown": raw.get("compute_median_s", 0.0) / none["compute_median_s"] - 1.0
        if none.get("compute_median_s")
        else 0.0,
        # for the ETTR model: none's step plus this strategy's own critical-path costs, which
        # are measured directly (whole-run differences on a shared machine are mostly noise)
        "model_step_s": none_step + critical / steps,
        "stall_s": raw["stall_s"],
        "stall_per_event_s": raw["stall_s"] / events if events else 0.0,
        "probe_s": raw["probe_s"],
        "probe_read_s": raw.get("probe_read_s", raw["probe_s"]),
        "probe_work_s": raw.get("probe_work_s"),  # absent from results before 2026-12-04
        "drift_every": raw.get("drift_every", 1),
        "bytes_written": raw["bytes_written"],
        "events": events,
        "bytes_per_event": raw["bytes_written"] / events if events else 0.0,
        "bytes_per_step": raw["bytes_written"] / steps,
        "mean_weighted_staleness": raw["freshness"]["mean_weighted_staleness"],
        "max_staleness": raw["freshness"]["max_staleness"],
        "mean_unsaved_drift": raw["freshness"]["mean_unsaved_drift"],
        "staleness_at_failure": _mean([r["weighted_staleness"] for r in recoveries]),
        "max_staleness_at_failure": max((r["max_staleness"] for r in recoveries), default=0),
        "plan_s": _mean([r["plan_s"] for r in recoveries]),
        "load_s": _mean([r["load_s"] for r in recoveries]),
        "replay_s": _mean([r["replay_s"] for r in recoveries]),
        "recovery_s": plan_load + delta_replay,
        "recovery_total_s": _mean([r["recovery_s"] for r in recoveries]),
        "steps_lost": _mean([r["steps_lost"] for r in recoveries]),
        "loss_dev_mean": deviation["mean"],
        "loss_dev_max": deviation["max"],
        "loss_dev_max_relative": deviation["max_relative"],
        # on the failure schedule, with none's training time plus this strategy's critical-path cost
        # (whole-run times on a shared machine vary by tens of percent between identical runs)
        "ettr": measured_ettr(
            productive_s=none["train_s"],
            train_s=none["train_s"] + critical,
            recovery_s=recovery_total,
            restart_s=restart_s,
            failures=len(failures),
        ),
        "ettr_no_restart": measured_ettr(
            productive_s=none["train_s"],
            train_s=none["train_s"] + critical,
            recovery_s=recovery_total,
            restart_s=0.0,
            failures=len(failures),
        ),
        "ettr_wall": measured_ettr(
            productive_s=none["train_s"],
            train_s=raw["train_s"],
            recovery_s=recovery_total,
            restart_s=restart_s,
            failures=len(failures),
        ),
        **recovery_report.recovery_figures(raw),
        "recoveries": recoveries,
    }


def build_report(raw: Mapping[str, Any], workload: Mapping[str, Any], machine: Mapping[str, Any]) -> dict[str, Any]:
    """The whole report (what ``--json`` prints and ``bench.json`` holds)."""
    results = {k: v for k, v in raw["results"].items() if not k.startswith("_")}
    steps, failures = workload["steps"], workload["failures"]
    none = results["none"]
    rows = {
        name: strategy_row(r, none, steps=steps, failures=failures, restart_s=raw["restart_s"])
        for name, r in results.items()
    }
    add_window_bytes(rows, since=workload["strategy"]["layercheck_warmup"], steps=steps)
    recovery_report.add_ratios(rows)
    add_matched_estimates(rows, results, steps=steps, eval_from=workload["strategy"]["layercheck_warmup"])
    frozen = int(raw.get("frozen_params", 0))
    schedule_report.add_peak_bytes(
        rows, results, full_bytes=schedule_report.full_checkpoint_bytes(raw["params"], frozen)
    )
    schedule_report.add_drift_matched(
        rows,
        results,
        params=raw["params"],
        frozen_params=frozen,
        steps=steps,
        eval_from=workload["strategy"]["layercheck_warmup"],
    )
    report = {
        "workload": dict(workload),
        "machine": dict(machine),
        "params": raw["params"],
        "layers": raw["layers"],
        "frozen_params": frozen,
        "restart_s": raw["restart_s"],
        "restart_parts": raw.get("restart_parts", {}),
        "matched": raw["results"].get("_matched"),
        "strategies": rows,
        "pairs": matched_pairs(rows),
        "loss_curves": {name: r["losses"] for name, r in results.items()},
        "raw": dict(raw),  # everything measured, so the report can be rebuilt without a rerun
    }
    report["headline"] = {
        **headline(report),
        **schedule_report.headline(rows),
        **recovery_report.headline(rows),
        **dcp_report.headline(rows),
    }
    return report


def bytes_from(row: Mapping[str, Any], *, since: int, steps: int, per_full_event: float | None) -> float | None:
    """The bytes a strategy wrote at steps ``>= since`` (LayerCheck's warm-up W: before it,
    LayerCheck writes nothing and protects nothing, so the fair comparison starts there).
    Interval kinds write equal-sized checkpoints at multiples of N; ``diff`` adds per-step deltas
    (their size is what remains of its bytes after its fulls of ``per_full_event`` each)."""
    kind, n = row["kind"], row["interval"]
    if kind == "none":
        return 0.0
    if kind == "layer-policy":
        return row["bytes_written"]  # nothing before the base at W
    if kind in ("deepspeed-sync", "deepspeed-async", "dcp-sync", "dcp-async", "layer-interval"):
        return row["bytes_per_event"] * checkpoints_in(n, since, steps)
    if kind == "differential" and per_full_event:
        fulls = steps // n
        deltas = row["events"] - fulls
        per_delta = (row["bytes_written"] - fulls * per_full_event) / deltas if deltas else 0.0
        delta_steps_from = sum(1 for t in range(max(n + 1, since), steps + 1) if t % n)
        return per_full_event * checkpoints_in(n, since, steps) + per_delta * delta_steps_from
    return None


def add_window_bytes(rows: dict[str, dict[str, Any]], *, since: int, steps: int) -> None:
    source = rows.get("full-resume") or rows.get("diff")
    per_full = source["bytes_per_event"] if source and source["kind"] == "layer-interval" else None
    for row in rows.values():
        row["bytes_from_warmup"] = bytes_from(row, since=since, steps=steps, per_full_event=per_full)


def add_matched_estimates(
    rows: dict[str, dict[str, Any]], results: Mapping[str, Any], *, steps: int, eval_from: int
) -> None:
    """For every LayerCheck variant, the intervals matching *its own* staleness and unsaved drift on
    the reference drift trace, and the bytes every-layer-together checkpoints would write there:
    the measured bytes of one such checkpoint (``full-resume``, same format; else ``full``) times
    the number of checkpoints from step W on (as :func:`bytes_from` counts). An estimate, for the
    variants that are not run at matched freshness."""
    from layercheck.policies.trace import DriftTrace

    source = rows.get("full-resume") or rows.get("full")
    if source is None or "trace" not in results.get("none", {}):
        return
    trace = DriftTrace.from_json(results["none"]["trace"])
    for row in rows.values():
        if row["kind"] != "layer-policy":
            continue
        m = matched_intervals(
            trace,
            target_staleness=row["mean_weighted_staleness"],
            target_drift=row["mean_unsaved_drift"],
            eval_from=eval_from,
        )
        by_stal = source["bytes_per_event"] * checkpoints_in(m.staleness, eval_from, steps)
        by_drift = source["bytes_per_event"] * checkpoints_in(m.drift, eval_from, steps)
        row["matched_estimate"] = {
            "per_checkpoint_bytes_from": source["name"],
            "interval_staleness": m.staleness,
            "interval_drift": m.drift,
            "full_bytes_staleness": by_stal,
            "full_bytes_drift": by_drift,
            "bytes_ratio_staleness": _ratio(row["bytes_written"], by_stal),
            "bytes_ratio_drift": _ratio(row["bytes_written"], by_drift),
        }


def matched_pairs(rows: Mapping[str, Mapping[str, Any]]) -> list[dict[str, Any]]:
    """LayerCheck against each baseline run at its matched interval: bytes and loss deviation."""
    lc = rows.get("layercheck")
    if lc is None:
        return []
    out = []
    for row in rows.values():
        if not row["matched"]:
            continue
        out.append(
            {
                "baseline": row["name"],
                "matched_on": row["matched"],
                "interval": row["interval"],
                "baseline_bytes": row["bytes_written"],
                "layercheck_bytes": lc["bytes_written"],
                "bytes_ratio": _ratio(lc["bytes_written"], row["bytes_written"]),
                "baseline_bytes_from_warmup": row["bytes_from_warmup"],
                "bytes_ratio_from_warmup": _ratio(lc["bytes_from_warmup"], row["bytes_from_warmup"])
                if row["bytes_from_warmup"] is not None
                else None,
                "baseline_loss_dev_mean": row["loss_dev_mean"],
                "layercheck_loss_dev_mean": lc["loss_dev_mean"],
                "baseline_loss_dev_max": row["loss_dev_max"],
                "layercheck_loss_dev_max": lc["loss_dev_max"],
                "baseline_staleness": row["mean_weighted_staleness"],
                "layercheck_staleness": lc["mean_weighted_staleness"],
                "baseline_unsaved_drift": row["mean_unsaved_drift"],
                "layercheck_unsaved_drift": lc["mean_unsaved_drift"],
            }
        )
    return out


def headline(report: Mapping[str, Any]) -> dict[str, Any]:
    """The few ratios the README quotes (``None`` where a strategy was not run)."""
    rows = report["strategies"]

    def get(name: str, key: str) -> Any:
        return rows[name][key] if name in rows else None

    def ratio(a: str, b: str, key: str) -> float | None:
        x, y = get(a, key), get(b, key)  # None where not run (or not defined)
        return _ratio(x, y) if x is not None and y is not None else None

    return {
        "bytes_layercheck_vs_full_at_matched_staleness": ratio("layercheck", "full@stal", "bytes_written"),
        "bytes_layercheck_vs_full_at_matched_drift": ratio("layercheck", "full@drift", "bytes_written"),
        "bytes_estimate_vs_full_at_own_matched_staleness": {
            name: row["matched_estimate"]["bytes_ratio_staleness"]
            for name, row in rows.items()
            if "matched_estimate" in row
        },
        "bytes_estimate_vs_full_at_own_matched_drift": {
            name: row["matched_estimate"]["bytes_ratio_drift"]
            for name, row in rows.items()
            if "matched_estimate" in row
        },
        "bytes_layercheck_vs_diff_at_matched_staleness": ratio("layercheck", "diff@stal", "bytes_written"),
        "bytes_from_warmup_layercheck_vs_full_at_matched_staleness": ratio(
            "layercheck", "full@stal", "bytes_from_warmup"
        ),
        "bytes_from_warmup_layercheck_vs_full_at_matched_drift": ratio("layercheck", "full@drift", "bytes_from_warmup"),
        "bytes_from_warmup_layercheck_vs_diff_at_matched_staleness": ratio(
            "layercheck", "diff@stal", "bytes_from_warmup"
        ),
        "overhead": {name: row["overhead"] for name, row in rows.items()},
        "recovery_s": {name: row["recovery_total_s"] for name, row in rows.items()},
        "recovery_layercheck_vs_full": ratio("layercheck", "full", "recovery_total_s"),
        "recovery_layercheck_vs_full_at_matched_staleness": ratio("layercheck", "full@stal", "recovery_total_s"),
        "ettr": {name: row["ettr"] for name, row in rows.items()},
        "loss_dev_max": {name: row["loss_dev_max"] for name, row in rows.items()},
    }


def _ratio(a: float, b: float) -> float:
    return a / b if b else float("inf")
