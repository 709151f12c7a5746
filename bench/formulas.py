"""Metric formulas of the benchmark: staleness and unsaved drift along a run, loss deviation
after a recovery, measured ETTR, and the intervals that match LayerCheck's freshness or its bytes.

Pure: values in, values out. The definitions follow ``policies/simulation.py`` so that a
measured run and a replayed trace are comparable: from ``eval_from`` on, per step, the
parameter-weighted staleness ``sum(numel * (t - t_last)) / sum(numel)`` and the weighted drift
accumulated since each layer's last save; a layer never saved counts from step 0.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from layercheck.policies.decision import StepObservation
from layercheck.policies.simulation import match_interval
from layercheck.policies.trace import DriftTrace


@dataclass
class FreshnessTracker:
    """Per-step staleness and unsaved drift of what is persisted, as a run goes."""

    numel: Mapping[str, int]
    eval_from: int = 0
    last: dict[str, int] = field(default_factory=dict)
    unsaved: dict[str, float] = field(default_factory=dict)
    weighted: list[float] = field(default_factory=list)
    unsaved_series: list[float] = field(default_factory=list)
    max_staleness: int = 0

    def __post_init__(self) -> None:
        self.last = {name: 0 for name in self.numel}
        self.unsaved = {name: 0.0 for name in self.numel}

    @property
    def total(self) -> int:
        return sum(self.numel.values())

    def observe(self, step: int, drift: Mapping[str, float], persisted: Iterable[str]) -> None:
        """After ``step``: each layer drifted by ``drift``; ``persisted`` were saved at ``step``."""
        for name in self.numel:
            self.unsaved[name] += float(drift.get(name, 0.0))
        for name in persisted:
            self.last[name] = step
            self.unsaved[name] = 0.0
        if step < self.eval_from:
            return
        staleness = {n: step - t for n, t in self.last.items()}
        self.weighted.append(sum(self.numel[n] * s for n, s in staleness.items()) / self.total)
        self.unsaved_series.append(sum(self.numel[n] * u for n, u in self.unsaved.items()) / self.total)
        self.max_staleness = max(self.max_staleness, max(staleness.values()))

    def recovered(self, versions: Mapping[str, int]) -> None:
        """The state was just reloaded from ``versions`` (layer -> step): nothing unsaved remains."""
        for name, step in versions.items():
            self.last[name] = step
            self.unsaved[name] = 0.0

    def weighted_staleness_now(self, step: int) -> float:
        return sum(self.numel[n] * (step - t) for n, t in self.last.items()) / self.total

    def max_staleness_now(self, step: int) -> int:
        return max(step - t for t in self.last.values())

    def summary(self) -> dict[str, float]:
        return {
            "mean_weighted_staleness": _mean(self.weighted),
            "max_staleness": float(self.max_staleness),
            "mean_unsaved_drift": _mean(self.unsaved_series),
            "max_unsaved_drift": max(self.unsaved_series, default=0.0),
        }


def loss_deviation(
    losses: Mapping[int, float], reference: Mapping[int, float], windows: Sequence[tuple[int, int]]
) -> dict[str, float]:
    """``|loss - reference|`` over the steps of ``windows`` (inclusive ranges): mean, max, and the
    max relative to the reference loss."""
    diffs, rel = [], []
    for start, end in windows:
        for step in range(start, end + 1):
            if step in losses and step in reference:
                d = abs(losses[step] - reference[step])
                diffs.append(d)
                rel.append(d / abs(reference[step]) if reference[step] else 0.0)
    return {
        "mean": _mean(diffs),
        "max": max(diffs, default=0.0),
        "max_relative": max(rel, default=0.0),
        "steps": len(diffs),
    }


def post_failure_windows(failures: Sequence[int], steps: int, length: int | None = None) -> list[tuple[int, int]]:
    """The steps after each failure up to the next one (or the end), at most ``length`` long."""
    out = []
    for i, f in enumerate(failures):
        end = failures[i + 1] if i + 1 < len(failures) else steps
        if length is not None:
            end = min(end, f + length)
        if end > f:
            out.append((f + 1, end))
    return out


def measured_ettr(*, productive_s: float, train_s: float, recovery_s: float, restart_s: float, failures: int) -> float:
    """Productive time (the failure-free ``none`` run's training time) over the wall-clock time
    this strategy needed for the same steps: its training, its recoveries, and a restart per failure."""
    wall = train_s + recovery_s + restart_s * failures
    return productive_s / wall if wall > 0 else 0.0


def trace_of(
    numel: Mapping[str, int], drifts: Mapping[int, Mapping[str, float]], lrs: Mapping[int, float]
) -> DriftTrace:
    """The run's drift trace (``layercheck.policies.trace`` format) from per-step global drift and LR."""
    steps = tuple(StepObservation(step=s, lr=lrs[s], drift=dict(drifts[s])) for s in sorted(drifts))
    return DriftTrace(layers=tuple(numel), numel=dict(numel), steps=steps)


@dataclass(frozen=True)
class MatchedIntervals:
    staleness: int
    drift: int
    target_staleness: float
    target_drift: float
    interval_staleness: float
    """The full-checkpoint staleness the chosen interval gives on the trace (what it was matched to)."""
    interval_drift: float


def matched_intervals(
    trace: DriftTrace, *, target_staleness: float, target_drift: float, eval_from: int
) -> MatchedIntervals:
    """Fixed intervals whose full checkpoints give, on ``trace``, the mean weighted staleness and
    the mean unsaved drift LayerCheck was measured at (``layercheck.policies.simulation.match_interval``)."""
    by_stal = match_interval(trace, target_staleness, lambda r: r.mean_weighted_staleness, eval_from=eval_from)
    by_drift = match_interval(trace, target_drift, lambda r: r.mean_unsaved_drift, eval_from=eval_from)
    assert by_stal.interval is not None and by_drift.interval is not None  # match_interval's are interval runs
    return MatchedIntervals(
        staleness=by_stal.interval,
        drift=by_drift.interval,
        target_staleness=target_staleness,
        target_drift=target_drift,
        interval_staleness=by_stal.mean_weighted_staleness,
        interval_drift=by_drift.mean_unsaved_drift,
    )


def checkpoints_in(n: int, since: int, until: int) -> int:
    """How many multiples of ``n`` lie in ``[since, until]``: the checkpoint steps of an interval
    ``n`` (its saves fall at every multiple of ``n``) in that window."""
    return until // n - (since - 1) // n if n >= 1 else 0


@dataclass(frozen=True)
class BytesMatch:
    interval: int | None
    """The interval whose full checkpoints come closest to the target bytes; ``None``: no interval
    does (``reason`` says why)."""
    checkpoints: int
    """Its full checkpoints in the window (0 where ``interval`` is ``None``)."""
    reason: str = ""


def bytes_matched_interval(*, per_checkpoint: float, target: float, since: int, steps: int) -> BytesMatch:
    """The interval N whose full checkpoints of ``per_checkpoint`` bytes each, counted from step
    ``since`` to ``steps`` (as :func:`checkpoints_in`: LayerCheck writes nothing before its warm-up
    W, so the window starts there), write the closest to ``target`` bytes; of equally close ones the
    shortest (the freshest baseline at those bytes). More than one checkpoint a step's worth gives
    N = 1; less than one checkpoint gives no interval: the only one left (a single save at the end
    of the run) protects nothing."""
    if per_checkpoint <= 0:
        return BytesMatch(interval=None, checkpoints=0, reason="no full checkpoint size was measured")
    if target < per_checkpoint:
        return BytesMatch(
            interval=None,
            checkpoints=0,
            reason=f"the target ({target:.0f} B) is less than one full checkpoint ({per_checkpoint:.0f} B)",
        )
    # the count is not monotonic in N (a multiple may fall just before ``since``): scan every N
    best = min(
        range(1, steps + 1),
        key=lambda n: (abs(per_checkpoint * checkpoints_in(n, since, steps) - target), n),
    )
    return BytesMatch(interval=best, checkpoints=checkpoints_in(best, since, steps))


def _mean(values: Sequence[float]) -> float:
    return statistics.fmean(values) if values else 0.0
