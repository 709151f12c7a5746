"""Replay a drift trace through a policy and measure what a user trades: bytes written against
how much a failure would lose (staleness and unsaved drift), each compared with fixed-interval
full checkpoints matched on the same freshness.

Measured from ``eval_from`` (the warm-up step, by default) to the end of the trace. A layer not
yet persisted counts from step 0 — the initial weights, which can always be reloaded.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from layercheck.policies.checkpoint_policy import CheckpointPolicy, IntervalPolicy, build_policy
from layercheck.policies.configs import IntervalConfig, LayerCheckConfig, PolicyConfig, StaggeredConfig, drift_measured
from layercheck.policies.staggered import BYTES_PER_PARAM, StaggeredPolicy  # bytes counted as the schedule plans them
from layercheck.policies.trace import DriftTrace


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
    peak_step_bytes: int = 0
    """The most bytes handed over at one step (a whole checkpoint for full checkpoints)."""
    peak_backlog_bytes: float = 0.0
    """The most bytes waiting to be written at once where storage writes the run's mean bytes per
    step (from its first save on), no faster: what the ranks hold in host memory meanwhile, and past
    ``persistence.max_inflight_bytes`` what they wait for. About a whole checkpoint for full
    checkpoints; about the largest layer for saves spread evenly over the steps."""

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
    drift_every: int = 1,
) -> SimulationResult:
    """Replay ``trace`` through ``policy``. ``drift_every`` (the policy config's): the policy sees
    drift only on the steps a run would measure (a recorded trace's own unmeasured steps stay
    unmeasured); the unsaved drift is counted on every step (estimated where none was measured)."""
    numel = trace.numel
    total = sum(numel.values())
    last = {name: 0 for name in trace.layers}
    unsaved = {name: 0.0 for name in trace.layers}
    persists = {name: 0 for name in trace.layers}
    events = written = peak = 0
    stal_sum = drift_sum = 0.0
    stal_max = 0
    drift_max = 0.0
    evaluated = 0
    series: list[tuple[int, int, float]] = []
    handed: list[int] = []  # bytes handed over at each step
    for obs in trace.filled().steps:  # a sampled run's unmeasured steps: estimated
        for name in trace.layers:
            unsaved[name] += obs.drift.get(name, 0.0)
        seen = obs if drift_measured(obs.step, drift_every) else replace(obs, drift={}, measured=False)
        decision = policy.observe(seen)
        step_bytes = 0
        if decision:
            events += 1
            for name in decision.names:
                persists[name] += 1
                step_bytes += numel[name] * bytes_per_param
                last[name] = obs.step
                unsaved[name] = 0.0
            written += step_bytes
            peak = max(peak, step_bytes)
        handed.append(step_bytes)
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
        peak_step_bytes=peak,
        peak_backlog_bytes=peak_backlog(handed),
    )


def peak_backlog(handed: Sequence[int]) -> float:
    """The most bytes of ``handed`` (per step) waiting at once where storage writes their mean per
    step from the first step that hands anything over (a warm-up before it saves nothing, and
    storage is not sized for it): each step adds what it hands over and takes away that mean
    (never below nothing)."""
    first = next((i for i, step_bytes in enumerate(handed) if step_bytes), len(handed))
    saving = handed[first:]
    if not saving:
        return 0.0
    rate = sum(saving) / len(saving)
    backlog = peak = 0.0
    for step_bytes in saving:
        backlog = max(0.0, backlog + step_bytes - rate)
        peak = max(peak, backlog)
    return peak


def simulate_config(
    trace: DriftTrace, config: PolicyConfig, *, label: str, eval_from: int = 0, keep_series: bool = False
) -> SimulationResult:
    policy = build_policy(config, {name: trace.numel[name] for name in trace.layers})
    return simulate(
        trace, policy, label=label, eval_from=eval_from, keep_series=keep_series, drift_every=config.drift_every
    )


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


def full_bytes_at(
    trace: DriftTrace, target: float, metric: Callable[[SimulationResult], float], *, eval_from: int = 0
) -> float:
    """Bytes full checkpoints write at exactly ``metric == target``: linear between the two
    intervals around it (alternating them gets there), clamped to every step / one save."""
    lo, hi = 1, max(1, len(trace.steps))
    while lo < hi:
        mid = (lo + hi) // 2
        if metric(simulate_interval(trace, mid, eval_from=eval_from)) < target:
            lo = mid + 1
        else:
            hi = mid
    above = simulate_interval(trace, lo, eval_from=eval_from)
    below = simulate_interval(trace, lo - 1, eval_from=eval_from) if lo > 1 else above
    return _between(below, above, target, metric)


@dataclass(frozen=True)
class OracleMatch:
    """The offline oracle at a target mean unsaved drift."""

    result: SimulationResult
    """Its run nearest the target from below (at least as fresh)."""
    bytes_at_target: float
    """Its bytes at exactly the target (linear between the two budgets around it)."""
    budget: int
    """Its byte budget per step in that run."""


def mean_rates(trace: DriftTrace) -> dict[str, float]:
    """Each layer's mean per-step drift over the whole trace: what the oracle knows."""
    measured = [o for o in trace.steps if o.measured]
    steps = max(1, len(measured))
    return {name: sum(o.drift.get(name, 0.0) for o in measured) / steps for name in trace.layers}


def simulate_oracle(trace: DriftTrace, budget: int, *, warmup_steps: int = 0, eval_from: int = 0) -> SimulationResult:
    """Per-layer periods ~ 1/sqrt(mean drift rate over the whole trace) filling ``budget`` bytes
    per step, staggered, no backstop: the schedule that knows the future."""
    config = StaggeredConfig(
        period=None,
        max_bytes_per_step=max(1, budget),
        warmup_steps=warmup_steps,
        smax=len(trace.steps) + 1,
        drift_every=1,  # (its rates are given)
    )
    policy = StaggeredPolicy(config, {n: trace.numel[n] for n in trace.layers}, rates=mean_rates(trace))
    return simulate(trace, policy, label=f"oracle/{budget}B", eval_from=eval_from)


def oracle_at_drift(trace: DriftTrace, target: float, *, warmup_steps: int = 0, eval_from: int = 0) -> OracleMatch:
    """The oracle swept over its byte budget to a target mean unsaved drift (bisection: a larger
    budget loses less drift)."""
    total = sum(trace.numel.values()) * BYTES_PER_PARAM

    def run(budget: int) -> SimulationResult:
        return simulate_oracle(trace, budget, warmup_steps=warmup_steps, eval_from=eval_from)

    lo, hi = 1, total  # lo: too little (drift above target) unless it is enough already
    fresh = run(hi)
    if fresh.mean_unsaved_drift > target:
        return OracleMatch(result=fresh, bytes_at_target=float(fresh.bytes_written), budget=hi)
    stale = run(lo)
    if stale.mean_unsaved_drift <= target:
        return OracleMatch(result=stale, bytes_at_target=float(stale.bytes_written), budget=lo)
    while hi - lo > 1:
        mid = math.isqrt(lo * hi) if hi > 4 * lo else (lo + hi) // 2
        mid = min(max(mid, lo + 1), hi - 1)
        result = run(mid)
        if result.mean_unsaved_drift <= target:
            hi, fresh = mid, result
        else:
            lo, stale = mid, result
    bytes_at = _between(fresh, stale, target, lambda r: r.mean_unsaved_drift)
    return OracleMatch(result=fresh, bytes_at_target=bytes_at, budget=hi)


def _between(
    a: SimulationResult, b: SimulationResult, target: float, metric: Callable[[SimulationResult], float]
) -> float:
    """Bytes at ``metric == target`` on the line through runs ``a`` and ``b`` (clamped to them)."""
    ma, mb = metric(a), metric(b)
    if ma == mb:
        return float(min(a.bytes_written, b.bytes_written))
    f = min(1.0, max(0.0, (target - ma) / (mb - ma)))
    return a.bytes_written + f * (b.bytes_written - a.bytes_written)


@dataclass(frozen=True)
class Comparison:
    """A policy's result beside full checkpoints matched on staleness and on unsaved drift."""

    result: SimulationResult
    matched_staleness: SimulationResult
    matched_drift: SimulationResult
    oracle: OracleMatch | None = None
    """The offline oracle at the same mean unsaved drift (when asked for)."""

    @property
    def bytes_vs_staleness_match(self) -> float:
        return _ratio(self.result.bytes_written, self.matched_staleness.bytes_written)

    @property
    def bytes_vs_drift_match(self) -> float:
        return _ratio(self.result.bytes_written, self.matched_drift.bytes_written)

    @property
    def bytes_vs_oracle(self) -> float:
        return _ratio(self.result.bytes_written, self.oracle.bytes_at_target) if self.oracle else float("nan")


def compare(
    trace: DriftTrace, config: PolicyConfig, *, label: str, eval_from: int = 0, oracle: bool = False
) -> Comparison:
    """``config``'s run beside full checkpoints matched on staleness and on unsaved drift, and
    (``oracle``) the offline oracle at its unsaved drift, warmed up as long (``eval_from``)."""
    result = simulate_config(trace, config, label=label, eval_from=eval_from, keep_series=True)
    return Comparison(
        result=result,
        matched_staleness=match_interval(
            trace, result.mean_weighted_staleness, lambda r: r.mean_weighted_staleness, eval_from=eval_from
        ),
        matched_drift=match_interval(
            trace, result.mean_unsaved_drift, lambda r: r.mean_unsaved_drift, eval_from=eval_from
        ),
        oracle=oracle_at_drift(trace, result.mean_unsaved_drift, warmup_steps=eval_from, eval_from=eval_from)
        if oracle
        else None,
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
