"""The intervals the matched variants of the interval baselines run at, from the first pass.

After every strategy has run once, the interval baselines run again (``layercheck.bench.strategies.
matched_variants``) at the interval of full checkpoints that matches ``layercheck``:

- ``@stal`` / ``@drift``: its measured mean weighted staleness / mean unsaved drift, on the
  ``none`` run's drift trace (``layercheck.policies.simulation.match_interval``);
- ``@bytes``: the bytes LayerCheck wrote (``layercheck+capture``'s, which include the
  survivors' captures, else ``layercheck``'s), per baseline from the measured size of one of its
  own full checkpoints, counted from the warm-up step W on as ``layercheck.bench.report.bytes_from`` counts
  (:func:`layercheck.bench.formulas.bytes_matched_interval`).

Every interval is floored at ``min_matched_interval``; the result says where the floor bound.
Pure: the first pass's results in, the intervals and their reasons out.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from layercheck.bench.formulas import bytes_matched_interval, matched_intervals
from layercheck.bench.presets import Workload
from layercheck.bench.strategies import BYTES_MATCHABLE, Strategy
from layercheck.orchestrator.table import human_bytes

#: Whose bytes ``@bytes`` matches, the first one run.
BYTES_TARGETS = ("layercheck+capture", "layercheck")


def matched_settings(
    results: Mapping[str, Mapping[str, Any]], workload: Workload, strategies: Sequence[Strategy]
) -> dict[str, Any]:
    """The matched intervals (``staleness``, ``drift``, ``bytes`` per baseline) and what they were
    matched to; ``results`` must hold ``none`` (with its trace) and ``layercheck``."""
    from layercheck.policies.trace import DriftTrace

    layercheck = results["layercheck"]
    m = matched_intervals(
        DriftTrace.from_json(results["none"]["trace"]),
        target_staleness=layercheck["freshness"]["mean_weighted_staleness"],
        target_drift=layercheck["freshness"]["mean_unsaved_drift"],
        eval_from=workload.strategy.layercheck_warmup,
    )
    floor = workload.strategy.min_matched_interval
    return {
        "staleness": max(m.staleness, floor),
        "drift": max(m.drift, floor),
        "clipped_to_min_interval": floor if min(m.staleness, m.drift) < floor else None,
        "target_staleness": m.target_staleness,
        "target_drift": m.target_drift,
        "interval_staleness": m.interval_staleness,
        "interval_drift": m.interval_drift,
        **bytes_settings(results, workload, strategies),
    }


def bytes_settings(
    results: Mapping[str, Mapping[str, Any]], workload: Workload, strategies: Sequence[Strategy]
) -> dict[str, Any]:
    """``bytes``: per full-checkpoint baseline run, the interval at LayerCheck's bytes (floored);
    ``bytes_skipped``: the baselines with none, and why; ``bytes_clipped_to_min_interval``: the
    floor where it raised one (``bytes_unfloored``: their intervals before it); the target and each
    baseline's checkpoint size."""
    target_name = next((n for n in BYTES_TARGETS if n in results), None)
    out: dict[str, Any] = {
        "bytes": {},
        "bytes_skipped": {},
        "bytes_clipped_to_min_interval": None,
        "bytes_unfloored": {},
        "bytes_target": target_name,
        "target_bytes": None,
        "bytes_per_checkpoint": {},
    }
    if target_name is None:
        return out
    w = workload.strategy
    target = float(results[target_name]["bytes_written"])  # a layer-wise policy writes nothing before W
    out["target_bytes"] = target
    for s in strategies:
        if s.kind not in BYTES_MATCHABLE or s.matched or s.name not in results:
            continue
        raw = results[s.name]
        per = raw["bytes_written"] / raw["events"] if raw.get("events") else 0.0
        out["bytes_per_checkpoint"][s.name] = per
        match = bytes_matched_interval(
            per_checkpoint=per, target=target, since=w.layercheck_warmup, steps=workload.steps
        )
        if match.interval is None:
            out["bytes_skipped"][s.name] = match.reason
            continue
        if match.interval < w.min_matched_interval:
            out["bytes_clipped_to_min_interval"] = w.min_matched_interval
            out["bytes_unfloored"][s.name] = match.interval
        out["bytes"][s.name] = max(match.interval, w.min_matched_interval)
    return out


def describe_bytes_match(m: Mapping[str, Any]) -> str:
    """One sentence: the ``@bytes`` intervals, what they matched, and where the floor bound or none
    was found (empty for a report from before ``@bytes``)."""
    if "bytes" not in m:
        return ""
    if m.get("bytes_target") is None:
        return "Matched bytes: no layercheck run to match."
    per, unfloored = m.get("bytes_per_checkpoint", {}), m.get("bytes_unfloored", {})
    parts = [
        f"`{name}@bytes` every **{n}** steps ({human_bytes(per[name])} a checkpoint"
        + (
            f"; {unfloored[name]} floored at `min_matched_interval` = {n}, so it writes fewer bytes"
            if name in unfloored
            else ""
        )
        + ")"
        for name, n in m["bytes"].items()
    ]
    parts += [f"no `{name}@bytes`: {reason}" for name, reason in m.get("bytes_skipped", {}).items()]
    return (
        f"Matched bytes: `{m['bytes_target']}` wrote {human_bytes(m['target_bytes'])} (from step W on), matched by "
        "the interval whose full checkpoints from step W on come closest to those bytes: "
        + ("; ".join(parts) or "no full-checkpoint baseline was run")
        + "."
    )
