"""Replay a drift trace through a policy and measure what a user trades: bytes written against
how much a failure would lose (staleness and unsaved drift), each compared with fixed-interval
full checkpoints matched on the same freshness.

Measured from ``eval_from`` (the warm-up step, by default) to the end of the trace. A layer not
yet persisted counts from step 0 — the initial weights, which can always be reloaded.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from policies.checkpoint_policy import CheckpointPolicy, IntervalPolicy, build_policy
from policies.configs import IntervalConfig, LayerCheckConfig, PolicyConfig
from policies.trace import DriftTrace

#: Bytes persisted per parameter: fp32 weight + Adam exp_avg + exp_avg_sq.
BYTES_PER_PARAM = 12


@dataclass(frozen=True)
class SimulationResult:
    policy: str
    events: int
    """Steps at which at least one layer was persisted."""
    persists: dict[str, int]
    """Per layer, how many versions were written."""
    bytes_written: int
    mean_weighted_staleness: float
    max_staleness: int
    mean_unsaved_drift: float
    """Parameter-weighted drift accumulated since each layer's last save, averaged over steps."""
    max_unsaved_drift: float
    staleness_series: tuple[tuple[int, int, float], ...]
    """Per evaluated step: (step, max staleness, weighted staleness)."""
    interval: int | None = None
    """For fixed-interval full checkpoints (:func:`simulate_interval`), their interval."""

    @property
    def bytes_per_event(self) -> float:
        return self.bytes_written / self.events if self.events else 0.0


def simulate(
    trace: DriftTrace,
    policy: CheckpointPolicy,
    *,
    label: str,
    eval_from: int = 0,
    bytes_per_param: int = BYTES_PER_PARAM,
    keep_series: bool = False,
) -> SimulationResult:
    numel = trace.numel
    total = sum(numel.values())
    last = {name: 0 for name in trace.layers}
    unsaved = {name: 0.0 for name in trace.layers}
    persists = {name: 0 for name in trace.layers}
    events = written = 0
    stal_sum = drift_sum = 0.0
    stal_max = 0
    drift_max = 0.0
    evaluated = 0
    series: list[tuple[int, int, float]] = []
    for obs in trace.steps:
        for name in trace.layers:
            unsaved[name] += obs.drift.get(name, 0.0)
        decision = policy.observe(obs)
        if decision:
            events += 1
            for name in decision.names:
                persists[name] += 1
                written += numel[name] * bytes_per_param
                last[name] = obs.step
                unsaved[name] = 0.0
        if obs.step < eval_from:
            continue
        evaluated += 1
        staleness = {name: obs.step - last[name] for name in trace.layers}
        weighted = sum(numel[n] * s for n, s in staleness.items()) / total
        lost = sum(numel[n] * u for n, u in unsaved.items()) / total
        stal_sum += weighted
        drift_sum += lost
        stal_max = max(stal_max, max(staleness.values()))
        drift_max = max(drift_max, lost)
        if keep_series:
            series.append((obs.step, max(staleness.values()), weighted))
    return SimulationResult(
        policy=label,
        events=events,
        persists=persists,
        bytes_written=written,
        mean_weighted_staleness=stal_sum / evaluated if evaluated else 0.0,
        max_staleness=stal_max,
        mean_unsaved_drift=drift_sum / evaluated if evaluated else 0.0,
        max_unsaved_drift=drift_max,
        staleness_series=tuple(series),
    )


def simulate_config(trace: DriftTrace, config: PolicyConfig, *, label: str, eval_from: int = 0,
                    keep_series: bool = False) -> SimulationResult:
    policy = build_policy(config, {name: trace.numel[name] for name in trace.layers})
    return simulate(trace, policy, label=label, eval_from=eval_from, keep_series=keep_series)


def simulate_interval(trace: DriftTrace, interval: int, *, eval_from: int = 0) -> SimulationResult:
    policy = IntervalPolicy(IntervalConfig(interval=interval), trace.layers)
    result = simulate(trace, policy, label=f"full/{interval}", eval_from=eval_from)  # the label is for display
    return replace(result, interval=interval)


def match_interval(
    trace: DriftTrace,
    target: float,
    metric: Callable[[SimulationResult], float],
    *,
    eval_from: int = 0,
) -> SimulationResult:
    """The fixed-interval full-checkpoint run whose ``metric`` is closest to ``target``.

    Both metrics used here (mean staleness, mean unsaved drift) grow with the interval, so a
    binary search finds the crossing; the closer of its two neighbours wins.
    """
    lo, hi = 1, max(1, len(trace.steps))
    while lo < hi:
        mid = (lo + hi) // 2
        if metric(simulate_interval(trace, mid, eval_from=eval_from)) < target:
            lo = mid + 1
        else:
            hi = mid
    candidates = [simulate_interval(trace, n, eval_from=eval_from) for n in {max(1, lo - 1), lo}]
    return min(candidates, key=lambda r: (abs(metric(r) - target), -r.events))


@dataclass(frozen=True)
class Comparison:
    """A policy's result beside full checkpoints matched on staleness and on unsaved drift."""

    result: SimulationResult
    matched_staleness: SimulationResult
    matched_drift: SimulationResult

    @property
    def bytes_vs_staleness_match(self) -> float:
        return _ratio(self.result.bytes_written, self.matched_staleness.bytes_written)

    @property
    def bytes_vs_drift_match(self) -> float:
        return _ratio(self.result.bytes_written, self.matched_drift.bytes_written)


def compare(trace: DriftTrace, config: PolicyConfig, *, label: str, eval_from: int = 0) -> Comparison:
    result = simulate_config(trace, config, label=label, eval_from=eval_from, keep_series=True)
    return Comparison(
        result=result,
        matched_staleness=match_interval(
            trace, result.mean_weighted_staleness, lambda r: r.mean_weighted_staleness, eval_from=eval_from
        ),
        matched_drift=match_interval(
            trace, result.mean_unsaved_drift, lambda r: r.mean_unsaved_drift, eval_from=eval_from
        ),
    )


def sweep_k0(
    trace: DriftTrace, base: LayerCheckConfig, k0_values: Sequence[float], *, eval_from: int = 0
) -> list[Comparison]:
    """The whole trade-off curve: one comparison per ``K0`` (``k0_embed`` scaled alongside)."""
    out = []
    for k0 in k0_values:
        scale = k0 / base.k0
        config = replace(base, k0=k0, k0_embed=base.k0_embed * scale)
        out.append(compare(trace, config, label=f"layercheck k0={k0:g}", eval_from=eval_from))
    return out


def _ratio(a: float, b: float) -> float:
    return a / b if b else float("inf")
