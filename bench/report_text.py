"""The benchmark report as text: the main table (one row per strategy), the matched-freshness
pairs, and the whole report as ``layercheck bench`` prints it. The report itself is
:mod:`layercheck.bench.report`'s; the markdown summary is :mod:`layercheck.bench.summary`'s.

Pure: the report in, strings out.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from layercheck.bench import dcp_report, recovery_report, schedule_report
from layercheck.bench.matched import describe_bytes_match
from layercheck.orchestrator.table import format_table, human_bytes

MAIN_COLUMNS = [
    "strategy",
    "N",
    "train s",
    "wall",
    "compute",
    "overhead",
    "stall s",
    "probe s",
    "reads s",
    "work s",
    "written",
    "events",
    "per event",
    "peak/step",
    "mean w-stal",
    "max stal",
    "stal@fail",
    "plan s",
    "load s",
    "replay s",
    "lost",
    "dev mean",
    "dev max",
    "ETTR",
    "ETTR-R",
]


def main_table(report: Mapping[str, Any]) -> str:
    rows = []
    for r in report["strategies"].values():
        rows.append(
            [
                r["name"],
                r["interval"] or "-",
                r["train_s"],
                f"{r['wall_overhead']:+.0%}",
                f"{r['compute_slowdown']:+.0%}",
                f"{r['overhead']:+.2%}",
                r["stall_s"],
                r["probe_s"],
                r.get("probe_read_s", r["probe_s"]),
                "-" if r.get("probe_work_s") is None else r["probe_work_s"],
                human_bytes(r["bytes_written"]),
                r["events"],
                human_bytes(r["bytes_per_event"]),
                "-" if r.get("peak_step_bytes") is None else human_bytes(r["peak_step_bytes"]),
                r["mean_weighted_staleness"],
                r["max_staleness"],
                r["staleness_at_failure"],
                r["plan_s"],
                r["load_s"],
                r["replay_s"],
                r["steps_lost"],
                r["loss_dev_mean"],
                r["loss_dev_max"],
                f"{r['ettr']:.3f}",
                f"{r['ettr_no_restart']:.3f}",
            ]
        )
    return format_table(MAIN_COLUMNS, rows)


def pairs_table(report: Mapping[str, Any]) -> str:
    rows = [
        [
            p["baseline"],
            p["matched_on"],
            p["interval"],
            human_bytes(p["baseline_bytes"]),
            human_bytes(p["layercheck_bytes"]),
            f"{p['bytes_ratio']:.2f}x",
            "-" if p["bytes_ratio_from_warmup"] is None else f"{p['bytes_ratio_from_warmup']:.2f}x",
            p["baseline_loss_dev_mean"],
            p["layercheck_loss_dev_mean"],
            p["baseline_loss_dev_max"],
            p["layercheck_loss_dev_max"],
        ]
        for p in report["pairs"]
    ]
    return format_table(
        [
            "baseline",
            "matched on",
            "N",
            "baseline bytes",
            "layercheck bytes",
            "LC/baseline",
            "from W",
            "dev mean (base)",
            "dev mean (LC)",
            "dev max (base)",
            "dev max (LC)",
        ],
        rows,
    )


def text(report: Mapping[str, Any]) -> str:
    w = report["workload"]
    m = report.get("matched") or {}
    lines = [
        f"workload {w['name']}: {report['params'] / 1e6:.2f}M params, {w['steps']} steps, "
        f"{'FSDP2' if w.get('engine') == 'fsdp2' else 'ZeRO-' + str(w['zero_stage'])} "
        f"{w['precision']}, {w['world_size']} ranks on {w['device']}, failures after steps {w['failures']}",
        main_table(report),
        "",
    ]
    recovered = recovery_report.recovery_table(report)
    if recovered:
        lines += [
            f"at recovery: unsaved drift = mean |θ_recovered - θ_true| per element at t_fail (all, the survivors' "
            f"slices, the lost rank {w['world_size'] - 1}'s); /LC: over layercheck's",
            recovered,
            "",
            "unsaved drift at recovery per layer:",
            recovery_report.layer_table(report),
            "",
        ]
    loads = recovery_report.load_table(report)
    if loads:
        lines += [
            f"recovery loads (store {report['raw'].get('store', 'local')}): mean load time per failure, bytes by "
            "source over all failures and ranks; load/storage twin: over the same strategy without +memory",
            loads,
            "",
        ]
    if any("at_matched_drift" in r for r in report["strategies"].values()):
        lines += [
            "layer-wise policies at their own mean unsaved drift (state bytes, 12 B/param; full counts "
            "frozen weights at 4 B/param):",
            schedule_report.drift_table(report),
            "",
        ]
    if m:
        lines.append(
            f"matched freshness: LayerCheck mean weighted staleness {m['target_staleness']:.3g} -> N={m['staleness']}"
            f"; mean unsaved drift {m['target_drift']:.3g} -> N={m['drift']}"
        )
        if describe_bytes_match(m):
            lines.append(describe_bytes_match(m).replace("`", "").replace("**", ""))
        lines.append(pairs_table(report))
    side_by_side = dcp_report.side_by_side(report)
    if side_by_side:
        lines += ["", "against DCP's async save (critical s: stalls, + probe and exchange for a layer-wise policy):"]
        lines += [side_by_side, *dcp_report.verdicts(report)]
    return "\n".join(lines)
