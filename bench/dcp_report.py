"""Under ``--engine fsdp2``: LayerCheck's strategies side by side with DCP's asynchronous save, the
FSDP2 user's own checkpoints (``dcp-async``: every N steps, rollback; :mod:`layercheck.bench.dcp_baseline`).

The comparison issue 58 asks for, per resuming strategy: its critical-path cost (its stalls plus
the drift probe and decision exchange it needs, the report's ``critical_s``) over ``dcp-async``'s
stalls at the same bytes (the target is at most :data:`CRITICAL_TARGET`); its recovery (plan + load;
a rollback adds re-running the lost steps) and steps re-run; the measured ETTR on the run's failures
and the cluster model's (``layercheck ettr``) at the MTBFs of :data:`MTBF_TARGETS`, each over
``dcp-async``'s. "At the same bytes" is, per strategy, the ``dcp-async`` run (at N, or a matched
interval: ``@bytes`` matches the paper policy's bytes, ``@stal``/``@drift`` its freshness) whose
bytes are nearest its own: the staggered default writes about a checkpoint every N steps, the
paper's policy several times that.

Pure: report rows (and an ETTR grid) in, dicts and a text table out.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from layercheck.orchestrator.table import format_table, human_bytes

BASELINE = "dcp-async"
#: LayerCheck's critical-path cost may be at most this many times DCP async's at the same bytes.
CRITICAL_TARGET = 1.2
#: The cluster MTBFs (hours) at which LayerCheck must be ahead on ETTR.
MTBF_TARGETS: tuple[float, ...] = (0.5, 2.0, 8.0)
#: The strategies set against the baseline: those that resume at ``t_fail + 1``.
RESUMING_KINDS = ("layer-policy", "layer-interval")


def _ratio(a: float, b: float) -> float:
    return a / b if b else float("inf")


def contenders(rows: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """The resuming strategies run at their own settings (not the matched variants)."""
    return [name for name, row in rows.items() if row["kind"] in RESUMING_KINDS and not row["matched"]]


def baselines(rows: Mapping[str, Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The ``dcp-async`` runs: at N and at the matched intervals."""
    return [row for row in rows.values() if row["kind"] == "dcp-async"]


def nearest_in_bytes(row: Mapping[str, Any], candidates: Sequence[Mapping[str, Any]]) -> Mapping[str, Any]:
    """The candidate whose bytes are nearest ``row``'s, as a ratio either way."""

    def distance(other: Mapping[str, Any]) -> float:
        a, b = row["bytes_written"], other["bytes_written"]
        return abs(math.log(a / b)) if a > 0 and b > 0 else math.inf

    return min(candidates, key=distance)


def headline(rows: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """``{"vs_dcp_async": ...}`` where ``dcp-async`` ran (else nothing): per resuming strategy, its
    figures and their ratios to the ``dcp-async`` run nearest it in bytes (``at_bytes``) and to
    ``dcp-async`` at the same interval N (``same_n``)."""
    base = rows.get(BASELINE)
    if base is None:
        return {}
    runs = baselines(rows)

    def versus(row: Mapping[str, Any], other: Mapping[str, Any]) -> dict[str, Any]:
        return {
            "baseline": other["name"],
            "interval": other["interval"],
            "bytes": _ratio(row["bytes_written"], other["bytes_written"]),
            "critical": _ratio(row["critical_s"], other["critical_s"]),
            "recovery": _ratio(row["recovery_total_s"], other["recovery_total_s"]),
            "ettr": _ratio(row["ettr"], other["ettr"]),
            "ettr_no_restart": _ratio(row["ettr_no_restart"], other["ettr_no_restart"]),
        }

    by_strategy = {}
    for name in contenders(rows):
        row = rows[name]
        at = versus(row, nearest_in_bytes(row, runs))
        by_strategy[name] = {
            "bytes_written": row["bytes_written"],
            "critical_s": row["critical_s"],
            "recovery_s": row["recovery_total_s"],
            "steps_lost": row["steps_lost"],
            "ettr": row["ettr"],
            "at_bytes": at,
            "same_n": versus(row, base),
            "critical_within_target": at["critical"] <= CRITICAL_TARGET,
        }
    return {
        "vs_dcp_async": {
            "critical_target": CRITICAL_TARGET,
            "baselines": {
                row["name"]: {
                    "interval": row["interval"],
                    "bytes_written": row["bytes_written"],
                    "critical_s": row["critical_s"],
                    "recovery_s": row["recovery_total_s"],
                    "steps_lost": row["steps_lost"],
                    "ettr": row["ettr"],
                }
                for row in runs
            },
            "by_strategy": by_strategy,
        }
    }


def cluster_ettr(
    grid: Mapping[str, Any], names: Sequence[str], mtbf_hours: Sequence[float] = MTBF_TARGETS
) -> dict[str, dict[float, float]]:
    """The cluster model's mean ETTR per strategy at each of ``mtbf_hours`` (those in ``grid``)."""
    out: dict[str, dict[float, float]] = {}
    for name in names:
        points = grid.get("by_mtbf", {}).get(name, [])
        out[name] = {p["mtbf_hours"]: p["sim"]["mean"] for p in points if p["mtbf_hours"] in mtbf_hours}
    return out


def side_by_side(report: Mapping[str, Any], grid: Mapping[str, Any] | None = None) -> str:
    """One row per resuming strategy and per DCP baseline: bytes, critical-path seconds, recovery,
    steps re-run, ETTR measured and (with ``grid``) the cluster model's at :data:`MTBF_TARGETS`,
    and the ratios to ``dcp-async`` at the same bytes; empty without a ``dcp-async`` row."""
    summary = report.get("headline", {}).get("vs_dcp_async")
    if not summary:
        return ""
    rows = report["strategies"]
    names = list(summary["baselines"]) + list(summary["by_strategy"])
    cluster = cluster_ettr(grid, names) if grid else {}
    headers = ["strategy", "N", "written", "critical s", "recovery s", "re-run", "ETTR"]
    headers += [f"ETTR {h:g}h" for h in MTBF_TARGETS] if cluster else []
    headers += ["nearest in bytes", "critical/its"]
    table = []
    for name in names:
        row = rows[name]
        ettrs = cluster.get(name, {})
        vs = summary["by_strategy"].get(name, {}).get("at_bytes")
        table.append(
            [
                name,
                row["interval"] or "-",
                human_bytes(row["bytes_written"]),
                row["critical_s"],
                row["recovery_total_s"],
                row["steps_lost"],
                f"{row['ettr']:.4f}",
                *([f"{ettrs[h]:.4f}" if h in ettrs else "-" for h in MTBF_TARGETS] if cluster else []),
                vs["baseline"] if vs else "-",
                f"{vs['critical']:.2f}x" if vs else "-",
            ]
        )
    return format_table(headers, table)


def verdicts(report: Mapping[str, Any], grid: Mapping[str, Any] | None = None) -> list[str]:
    """Per resuming strategy, whether it meets each target against ``dcp-async`` at the same bytes
    (critical path within :data:`CRITICAL_TARGET`, recovery faster, cluster ETTR ahead at each of
    :data:`MTBF_TARGETS`), as sentences whose every figure is the report's."""
    summary = report.get("headline", {}).get("vs_dcp_async")
    if not summary:
        return []
    rows = report["strategies"]
    names = list(summary["by_strategy"])
    cluster = cluster_ettr(grid, [*summary["baselines"], *names]) if grid else {}
    out = []
    for name in names:
        s = summary["by_strategy"][name]
        vs = s["at_bytes"]
        parts = [
            f"critical path {vs['critical']:.2f}x `{vs['baseline']}`'s "
            f"({'within' if vs['critical'] <= CRITICAL_TARGET else 'over'} {CRITICAL_TARGET:g}x)",
            f"recovery {vs['recovery']:.2f}x ({'ahead' if vs['recovery'] < 1 else 'behind'}; "
            f"{s['steps_lost']:g} steps re-run against {rows[vs['baseline']]['steps_lost']:g})",
        ]
        base_cluster, own = cluster.get(vs["baseline"], {}), cluster.get(name, {})
        ahead = [f"{h:g} h {own[h] / base_cluster[h]:.3f}x" for h in MTBF_TARGETS if h in own and h in base_cluster]
        if ahead:
            parts.append("cluster ETTR " + ", ".join(ahead))
        out.append(f"- `{name}` against `{vs['baseline']}` (bytes {vs['bytes']:.2f}x): " + "; ".join(parts) + ".")
    return out
