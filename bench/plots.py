"""Plots of a benchmark report and of an ETTR grid (PNG, matplotlib's Agg backend)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

FLOOR = 1e-6


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def bytes_vs_staleness(report: Mapping[str, Any], path: Path) -> Path:
    """Bytes written against mean weighted staleness: the freshness each byte buys."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for row in report["strategies"].values():
        if row["kind"] == "none":
            continue
        marker = "*" if row["kind"] == "layer-policy" else ("s" if row["matched"] else "o")
        ax.scatter(
            row["mean_weighted_staleness"], row["bytes_written"] / 2**20, marker=marker, s=80 if marker == "*" else 40
        )
        ax.annotate(
            row["name"],
            (row["mean_weighted_staleness"], row["bytes_written"] / 2**20),
            fontsize=7,
            xytext=(3, 3),
            textcoords="offset points",
        )
    frontier = _full_frontier(report)
    if frontier:
        ax.plot(
            *zip(*frontier),
            color="grey",
            lw=0.8,
            ls="--",
            zorder=0,
            label="full checkpoints every N (on the measured trace)",
        )
        ax.legend(fontsize=7)
    ax.set_xlabel("mean parameter-weighted staleness (steps)")
    ax.set_ylabel("bytes written (MiB, all ranks)")
    ax.set_title(f"{report['workload']['name']}: bytes vs freshness")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _full_frontier(report: Mapping[str, Any]) -> list[tuple[float, float]]:
    """(staleness, MiB) of every-layer checkpoints every N steps: staleness replayed on the
    reference run's drift trace, bytes = measured size of one such checkpoint x checkpoints."""
    from layercheck.policies.simulation import simulate_interval
    from layercheck.policies.trace import DriftTrace

    rows = report["strategies"]
    source = rows.get("full-resume") or rows.get("full")
    trace_json = report.get("raw", {}).get("results", {}).get("none", {}).get("trace")
    if source is None or trace_json is None:
        return []
    trace = DriftTrace.from_json(trace_json)
    eval_from = report["workload"]["strategy"]["layercheck_warmup"]
    points = []
    for n in range(2, report["workload"]["steps"] // 2):
        r = simulate_interval(trace, n, eval_from=eval_from)
        points.append((r.mean_weighted_staleness, source["bytes_per_event"] * r.events / 2**20))
    return points


def loss_deviation(report: Mapping[str, Any], path: Path) -> Path:
    """|loss - failure-free loss| per step after the first failure, per strategy."""
    plt = _pyplot()
    curves = report["loss_curves"]
    reference = {int(k): v for k, v in curves["none"].items()}
    first = report["workload"]["failures"][0]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, losses in curves.items():
        if name == "none" or "@" in name:
            continue
        steps = sorted(int(k) for k in losses if int(k) > first)
        ax.plot(steps, [max(abs(losses[str(s)] - reference[s]), FLOOR) for s in steps], label=name, lw=1)
    for f in report["workload"]["failures"]:
        ax.axvline(f, color="grey", ls=":", lw=0.8)
    ax.set_yscale("log")
    ax.set_ylim(bottom=FLOOR / 2)
    ax.set_xlabel("step")
    ax.set_ylabel("|loss - failure-free loss|")
    ax.set_title(f"loss deviation after recovery (dotted: failures; 0 drawn at {FLOOR:g})")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def ettr_curves(ettr: Mapping[str, Any], path: Path) -> Path:
    """ETTR against cluster MTBF and against GPU count (simulation mean, 5-95 % band)."""
    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    for name, points in ettr["by_mtbf"].items():
        if "@" in name or name == "none":
            continue
        x = [p["mtbf_hours"] for p in points]
        left.plot(x, [p["sim"]["mean"] for p in points], marker="o", ms=3, label=name)
        left.fill_between(x, [p["sim"]["p05"] for p in points], [p["sim"]["p95"] for p in points], alpha=0.12)
    for name, points in ettr["by_gpus"].items():
        if "@" in name or name == "none":
            continue
        x = [p["gpus"] for p in points]
        right.plot(x, [p["sim"]["mean"] for p in points], marker="o", ms=3, label=name)
    left.set_xscale("log")
    left.set_xlabel("cluster MTBF (hours)")
    left.set_ylabel("ETTR")
    left.set_title("ETTR vs MTBF (none, no checkpoints: see ettr.json)")
    right.set_xscale("log", base=2)
    right.set_xlabel(f"GPUs (per-GPU MTBF {ettr['per_gpu_mtbf_hours']:g} h)")
    right.set_title("ETTR vs cluster size")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
