"""What a recovery brought back, per strategy: the unsaved drift at recovery measured on the state
(:mod:`bench.unsaved`), split into the survivors' and the lost rank's slices and per layer, next
to the loss deviation after the failures and the bytes written, as ratios to ``layercheck``
(the paper's policy without a recovery tier): what the survivors' capture (and later the memory
tier) adds, at the writes it costs.

Pure: the report's rows and raw results in, figures and tables out.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from orchestrator.table import format_table, human_bytes

#: The row the ratios are taken against.
REFERENCE = "layercheck"


def recovery_figures(raw: Mapping[str, Any]) -> dict[str, Any]:
    """A strategy's unsaved drift at recovery (mean over its failures; ``None`` where none was
    measured) and its capture bytes."""
    measured = [r["unsaved"] for r in raw.get("recoveries", ()) if "unsaved" in r]
    out: dict[str, Any] = {"capture_bytes": float(raw.get("capture_bytes", 0.0))}
    if not measured:
        return {**out, "unsaved_at_recovery": None}
    layers = measured[0]["layers"]
    return {
        **out,
        "unsaved_at_recovery": _mean([u["mean_abs"] for u in measured]),
        "unsaved_per_failure": [u["mean_abs"] for u in measured],
        "unsaved_survivors": _mean([u["survivors_mean_abs"] for u in measured]),
        "unsaved_lost_rank": _mean([u["lost_mean_abs"] for u in measured]),
        "unsaved_layers": {name: _mean([u["layers"][name]["mean_abs"] for u in measured]) for name in layers},
    }


def add_ratios(rows: dict[str, dict[str, Any]]) -> None:
    """Each measured row's unsaved drift, loss deviation and bytes over ``layercheck``'s."""
    ref = rows.get(REFERENCE)
    if ref is None or ref.get("unsaved_at_recovery") is None:
        return
    for row in rows.values():
        if row.get("unsaved_at_recovery") is None:
            continue
        row["unsaved_at_recovery_vs_layercheck"] = _ratio(row["unsaved_at_recovery"], ref["unsaved_at_recovery"])
        row["loss_dev_mean_vs_layercheck"] = _ratio(row["loss_dev_mean"], ref["loss_dev_mean"])
        row["bytes_vs_layercheck"] = _ratio(row["bytes_written"], ref["bytes_written"])


def headline(rows: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    return {
        "unsaved_at_recovery_vs_layercheck": {
            name: row["unsaved_at_recovery_vs_layercheck"]
            for name, row in rows.items()
            if "unsaved_at_recovery_vs_layercheck" in row
        },
    }


COLUMNS = [
    "strategy",
    "written",
    "capture",
    "bytes/LC",
    "unsaved@rec",
    "/LC",
    "per failure",
    "survivors",
    "lost rank",
    "dev mean",
    "/LC",
    "dev max",
]


def recovery_table(report: Mapping[str, Any]) -> str:
    """One row per strategy whose recoveries were measured."""
    rows = []
    for r in report["strategies"].values():
        if r.get("unsaved_at_recovery") is None:
            continue
        rows.append(
            [
                r["name"],
                human_bytes(r["bytes_written"]),
                human_bytes(r["capture_bytes"]),
                _times(r.get("bytes_vs_layercheck")),
                f"{r['unsaved_at_recovery']:.3e}",
                _times(r.get("unsaved_at_recovery_vs_layercheck")),
                ", ".join(f"{u:.2e}" for u in r.get("unsaved_per_failure", ())),
                f"{r['unsaved_survivors']:.3e}",
                f"{r['unsaved_lost_rank']:.3e}",
                r["loss_dev_mean"],
                _times(r.get("loss_dev_mean_vs_layercheck")),
                r["loss_dev_max"],
            ]
        )
    return format_table(COLUMNS, rows) if rows else ""


def layer_table(report: Mapping[str, Any], names: Sequence[str] | None = None) -> str:
    """Per layer (rows), each measured strategy's unsaved drift at recovery (columns)."""
    measured = [r for r in report["strategies"].values() if r.get("unsaved_at_recovery") is not None]
    if names is not None:
        measured = [r for r in measured if r["name"] in names]
    if not measured:
        return ""
    layers = list(measured[0]["unsaved_layers"])
    rows = [[layer, *[f"{r['unsaved_layers'][layer]:.3e}" for r in measured]] for layer in layers]
    return format_table(["layer", *[r["name"] for r in measured]], rows)


def _times(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _mean(values: Sequence[float]) -> float:
    return statistics.fmean(values) if values else 0.0


def _ratio(a: float, b: float) -> float:
    return a / b if b else (0.0 if a == 0 else float("inf"))
