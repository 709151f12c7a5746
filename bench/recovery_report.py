"""What a recovery brought back, per strategy: the unsaved drift at recovery measured on the state
(:mod:`layercheck.bench.unsaved`), split into the survivors' and the lost rank's slices and per layer, next
to the loss deviation after the failures and the bytes written, as ratios to ``layercheck``
(the paper's policy without a recovery tier): what the survivors' capture adds, at the writes it
costs; and the layer-wise policies over ``full-resume@bytes``, the resuming interval baseline
writing LayerCheck's bytes (:mod:`layercheck.bench.matched`). And where each recovery's shard files came
from (the writers' memory or storage) with its load time, against the same strategy without the
memory tier (its ``storage twin``): what the memory tier saves.

Pure: the report's rows and raw results in, figures and tables out.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from layercheck.orchestrator.table import format_table, human_bytes

#: The row the ratios are taken against.
REFERENCE = "layercheck"
#: The resuming interval baseline at LayerCheck's bytes (``layercheck.bench.matched``): what a layer-wise
#: policy's unsaved drift and loss deviation are held against at the same writes.
AT_BYTES = "full-resume@bytes"


#: A recovery's loaded bytes by source (``layercheck.orchestrator.core.memory.reads.LoadSources``, summed over ranks).
MEMORY_SOURCES = ("memory_local", "memory_remote")


def recovery_figures(raw: Mapping[str, Any]) -> dict[str, Any]:
    """A strategy's unsaved drift at recovery (mean over its failures; ``None`` where none was
    measured), its capture bytes, its recovery tiers and where its recoveries' bytes came from."""
    measured = [r["unsaved"] for r in raw.get("recoveries", ()) if "unsaved" in r]
    out: dict[str, Any] = {
        "capture_bytes": float(raw.get("capture_bytes", 0.0)),
        "tiers": list(raw["strategy"].get("tiers", ())),
        **load_sources(raw.get("recoveries", ())),
    }
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


def load_sources(recoveries: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Bytes (and shard files) the recoveries loaded from the writers' memory and from storage,
    summed over failures and ranks; empty where no recovery reported them (rollbacks, ``none``)."""
    reported = [r["sources"] for r in recoveries if r.get("sources")]
    if not reported:
        return {}

    def total(field: str) -> float:
        return float(sum(s.get(field, 0) for s in reported))

    memory = sum(total(f"{m}_bytes") for m in MEMORY_SOURCES)
    storage = total("storage_bytes")
    composite = float(sum(r.get("composite_bytes", 0) for r in recoveries if r.get("sources")))
    load_s = float(sum(r.get("load_s", 0.0) for r in recoveries if r.get("sources")))
    return {
        "read_vs_composite": (memory + storage) / composite if composite else None,
        "load_gb_per_s": (memory + storage) / load_s / 1e9 if load_s else None,
        "loaded_from_memory_bytes": memory,
        "loaded_from_memory_shards": sum(total(f"{m}_shards") for m in MEMORY_SOURCES),
        "loaded_from_storage_bytes": storage,
        "loaded_from_storage_shards": total("storage_shards"),
        "loaded_memory_share": memory / (memory + storage) if memory + storage else 0.0,
    }


def storage_twin(rows: Mapping[str, Mapping[str, Any]], name: str) -> str | None:
    """The row of the same strategy without the memory tier (``a+memory`` → ``a``), if run."""
    row = rows[name]
    if "memory" not in row.get("tiers", ()):
        return None
    twin = name.replace("+memory", "")
    return twin if twin in rows and "memory" not in rows[twin].get("tiers", ()) else None


def add_ratios(rows: dict[str, dict[str, Any]]) -> None:
    """Each measured row's unsaved drift, loss deviation and bytes over ``layercheck``'s; a
    memory-tier row's recovery load time over its storage twin's."""
    for name, row in rows.items():
        twin = storage_twin(rows, name)
        if twin is not None:
            row["load_vs_storage"] = _ratio(row["load_s"], rows[twin]["load_s"])
            row["load_storage_twin"] = twin
    at_bytes = rows.get(AT_BYTES)
    if at_bytes is not None and at_bytes.get("unsaved_at_recovery") is not None:
        for row in rows.values():
            if row["kind"] == "layer-policy" and row.get("unsaved_at_recovery") is not None:
                row["unsaved_vs_full_resume_at_bytes"] = _ratio(
                    row["unsaved_at_recovery"], at_bytes["unsaved_at_recovery"]
                )
                row["loss_dev_mean_vs_full_resume_at_bytes"] = _ratio(row["loss_dev_mean"], at_bytes["loss_dev_mean"])
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
        "recovery_load_memory_vs_storage": {
            name: row["load_vs_storage"] for name, row in rows.items() if "load_vs_storage" in row
        },
        # at the same bytes written: the layer-wise policies over full-resume there, and what
        # the rollback there re-runs per failure (its unsaved drift is 0: it replays)
        "unsaved_vs_full_resume_at_bytes": {
            name: row["unsaved_vs_full_resume_at_bytes"]
            for name, row in rows.items()
            if "unsaved_vs_full_resume_at_bytes" in row
        },
        "loss_dev_vs_full_resume_at_bytes": {
            name: row["loss_dev_mean_vs_full_resume_at_bytes"]
            for name, row in rows.items()
            if "loss_dev_mean_vs_full_resume_at_bytes" in row
        },
        "steps_lost_full_at_bytes": rows["full@bytes"]["steps_lost"] if "full@bytes" in rows else None,
    }


COLUMNS = [
    "strategy",
    "N",
    "lost",
    "written",
    "capture",
    "bytes/LC",
    "unsaved@rec",
    "/LC",
    "/FR@bytes",
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
                r["interval"] or "-",
                r["steps_lost"],
                human_bytes(r["bytes_written"]),
                human_bytes(r["capture_bytes"]),
                _times(r.get("bytes_vs_layercheck")),
                f"{r['unsaved_at_recovery']:.3e}",
                _times(r.get("unsaved_at_recovery_vs_layercheck")),
                _times(r.get("unsaved_vs_full_resume_at_bytes")),
                ", ".join(f"{u:.2e}" for u in r.get("unsaved_per_failure", ())),
                f"{r['unsaved_survivors']:.3e}",
                f"{r['unsaved_lost_rank']:.3e}",
                r["loss_dev_mean"],
                _times(r.get("loss_dev_mean_vs_layercheck")),
                r["loss_dev_max"],
            ]
        )
    return format_table(COLUMNS, rows) if rows else ""


LOAD_COLUMNS = [
    "strategy",
    "tiers",
    "load s",
    "from memory",
    "from storage",
    "memory share",
    "read/composite",
    "GB/s",
    "load/storage twin",
]


def load_table(report: Mapping[str, Any]) -> str:
    """One row per strategy whose recoveries said where their bytes came from: the mean load time
    per failure, the bytes read from memory and from storage (all failures, all ranks), the bytes
    read over the composite's, the load bandwidth (bytes read over load seconds, ranks in
    parallel), and a memory tier's load time over its storage twin's."""
    rows = []
    for r in report["strategies"].values():
        if "loaded_memory_share" not in r:
            continue
        twin = r.get("load_storage_twin")
        rows.append(
            [
                r["name"],
                "+".join(r.get("tiers", ())) or "-",
                f"{r['load_s']:.4f}",
                f"{human_bytes(r['loaded_from_memory_bytes'])} ({r['loaded_from_memory_shards']:.0f} files)",
                f"{human_bytes(r['loaded_from_storage_bytes'])} ({r['loaded_from_storage_shards']:.0f} files)",
                f"{r['loaded_memory_share']:.0%}",
                _times(r.get("read_vs_composite")),
                "-" if r.get("load_gb_per_s") is None else f"{r['load_gb_per_s']:.2f}",
                f"{_times(r.get('load_vs_storage'))} of {twin}" if twin else "-",
            ]
        )
    return format_table(LOAD_COLUMNS, rows) if rows else ""


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
