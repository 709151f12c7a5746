"""The control plane's measured costs per GPU count, from a ``scale.json`` (``layercheck bench
--scale``), as the cluster model takes them (``layercheck ettr --scale``, ``bench/scale/sizing.py``).

Per row (one N): the recovery plan's time (``plan_s`` less the writers' drain, ``drain_s``, where
the row has it: the drain is what was in flight when the group was lost, written first, so it
measures storage and the harness machine's cores, not the plan; the cluster model charges it from
storage's bandwidth instead, ``sizing.py``), the control actors' CPU per step
(``control_cpu_ms_per_step``: the policy actor's and the supervisor's) and the decision latency
(``decision_latency_ms``). At a GPU count N (one rank per GPU) each figure is the row's where N was
measured, interpolated linearly between the two rows around N, held at the first row's below it
(a cost does not fall under its fixed part), and past the last row extrapolated linearly through the
last two rows (never below the last: a cost is not taken to fall with N) or, from one row, in
proportion to N. ``plan_many`` (the plan over a long history at one N) adds what a long history
costs beyond that N's row: the rows' runs are minutes long, a week-long run's plan is not.

The decision latency is carried and printed, not charged: on the harness's machine (2 cores for
every simulated rank and actor) it measures that machine, while the CPU per step is the design's
cost (issue 59). What the model charges a step is the control actors' CPU beyond the step time:
a control plane that needs more CPU per step than a step lasts falls behind by the difference every
step, and the ranks, which collect each decision one step later, wait for it.

Pure arithmetic over a parsed report; no Ray.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

#: How a figure at N was taken from the rows.
MEASURED = "measured"
INTERPOLATED = "interpolated"
BELOW = "as at the smallest N"
EXTRAPOLATED = "extrapolated"


@dataclass(frozen=True, kw_only=True)
class Taken:
    """One figure at one N, and how it was taken from the rows."""

    value: float
    how: str
    """:data:`MEASURED`, :data:`INTERPOLATED`, :data:`BELOW` or :data:`EXTRAPOLATED`."""
    rows: tuple[int, ...]
    """The rows' N it was taken from."""

    def describe(self) -> str:
        ns = ", ".join(f"N={n:,}" for n in self.rows)
        return f"{self.how} ({ns})" if self.how != MEASURED else MEASURED


def take(points: Sequence[tuple[int, float]], n: int) -> Taken:
    """The value at ``n`` of the measured ``(N, value)`` ``points`` (see the module)."""
    ordered = sorted(points)
    if not ordered:
        raise ValueError("no measured rows to take a figure from")
    for (n0, v0), (n1, v1) in zip(ordered, ordered[1:], strict=False):
        if n0 < n < n1:
            return Taken(value=v0 + (v1 - v0) * (n - n0) / (n1 - n0), how=INTERPOLATED, rows=(n0, n1))
    exact = [v for m, v in ordered if m == n]
    if exact:
        return Taken(value=exact[0], how=MEASURED, rows=(n,))
    first_n, first_v = ordered[0]
    if n < first_n:
        return Taken(value=first_v, how=BELOW, rows=(first_n,))
    last_n, last_v = ordered[-1]
    if len(ordered) == 1:
        return Taken(value=last_v * n / last_n, how=EXTRAPOLATED, rows=(last_n,))
    before_n, before_v = ordered[-2]
    slope = (last_v - before_v) / (last_n - before_n)
    return Taken(value=max(last_v, last_v + slope * (n - last_n)), how=EXTRAPOLATED, rows=(before_n, last_n))


@dataclass(frozen=True, kw_only=True)
class ControlPlaneCost:
    """The control plane's costs at ``n_ranks`` GPUs, as the cluster model charges them."""

    n_ranks: int
    plan: Taken
    """The recovery plan, seconds (a long history's share included: :attr:`ScaleCosts.history_s`)."""
    control_cpu: Taken
    """The policy actor's and the supervisor's CPU per step, seconds."""
    decision_latency: Taken | None
    """A measured step's decision, report to answer, median seconds (None: no row has it)."""

    @property
    def plan_s(self) -> float:
        return self.plan.value

    @property
    def control_cpu_s(self) -> float:
        return self.control_cpu.value

    def unfit_s(self, step_s: float) -> float:
        """The control actors' CPU per step beyond a step of ``step_s``: what every step waits."""
        return max(0.0, self.control_cpu_s - step_s)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True, kw_only=True)
class ScaleCosts:
    """A ``scale.json``'s rows as per-N costs (:meth:`at`)."""

    plan_points: tuple[tuple[int, float], ...]
    cpu_points: tuple[tuple[int, float], ...]
    latency_points: tuple[tuple[int, float], ...]
    history_s: float = 0.0
    """What a long history adds to a plan (``plan_many``): the product's plan over
    :attr:`history_versions` versions less the row's plan at that N, at least 0."""
    history_versions: int = 0
    harness_step_s: float | None = None
    """The harness's step time (its config's ``step_s``): what the decision latency was measured against."""

    def at(self, n: int) -> ControlPlaneCost:
        plan = take(self.plan_points, n)
        return ControlPlaneCost(
            n_ranks=n,
            plan=Taken(value=plan.value + self.history_s, how=plan.how, rows=plan.rows),
            control_cpu=take(self.cpu_points, n),
            decision_latency=take(self.latency_points, n) if self.latency_points else None,
        )

    @property
    def largest_n(self) -> int:
        return max(n for n, _ in self.cpu_points)


def _finite(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and math.isfinite(value) else None


def scale_costs(report: Mapping[str, Any]) -> ScaleCosts:
    """The per-N costs of a parsed ``scale.json``. Rows without a figure (no failure, so no plan;
    a latency the run did not measure) are left out of that figure's points."""
    rows = report.get("rows") or []
    cpu = [(int(r["n_ranks"]), v / 1e3) for r in rows if (v := _finite(r.get("control_cpu_ms_per_step"))) is not None]
    plan = [
        (int(r["n_ranks"]), v - (_finite(r.get("drain_s")) or 0.0))
        for r in rows
        if (v := _finite(r.get("plan_s"))) is not None
    ]
    latency = [
        (int(r["n_ranks"]), v / 1e3)
        for r in rows
        if (v := _finite((r.get("decision_latency_ms") or {}).get("median"))) is not None
    ]
    if not cpu:
        raise ValueError("scale.json has no row with control_cpu_ms_per_step: run `layercheck bench --scale`")
    if not plan:
        raise ValueError("scale.json has no row with plan_s (a run with its failure): run `layercheck bench --scale`")
    history_s, history_versions = _history(report.get("plan_many") or [], plan)
    step_s = _finite((report.get("config") or {}).get("step_s"))
    return ScaleCosts(
        plan_points=tuple(plan),
        cpu_points=tuple(cpu),
        latency_points=tuple(latency),
        history_s=history_s,
        history_versions=history_versions,
        harness_step_s=step_s,
    )


def _history(plan_many: Sequence[Mapping[str, Any]], plan: Sequence[tuple[int, float]]) -> tuple[float, int]:
    """The longest measured history's plan (the supervisor's own, ``kept_plan_s``, as a running
    run's recovery plans) beyond the rows' plan at its N; 0 without one."""
    measured = [p for p in plan_many if _finite(p.get("kept_plan_s", p.get("plan_s"))) is not None]
    if not measured:
        return 0.0, 0
    longest = max(measured, key=lambda p: int(p["versions"]))
    seconds = float(longest.get("kept_plan_s", longest.get("plan_s")))
    return max(0.0, seconds - take(plan, int(longest["n_ranks"])).value), int(longest["versions"])


def describe(costs: ScaleCosts, gpus: Sequence[int], *, step_s: float, source: str) -> str:
    """What the cluster model takes from ``source`` at each of ``gpus``, against a step of ``step_s``."""
    history = (
        f"; a plan over {costs.history_versions:,} committed versions adds {costs.history_s:.2f} s (plan_many)"
        if costs.history_versions
        else "; no plan_many: the plan is the rows' short history's"
    )
    lines = [
        f"from {source} (rows at N = {', '.join(f'{n:,}' for n, _ in costs.cpu_points)}{history}): at each GPU count, "
        "LayerCheck's strategies (those resuming at t_fail + 1) recover in the plan's seconds more, and each step "
        f"waits for the control actors' CPU beyond a {step_s:.3g} s step",
        f"{'GPUs':>6}  {'plan s':>8}  {'control CPU ms/step':>19}  {'beyond the step':>15}  "
        f"{'decision ms (not charged)':>25}  taken",
    ]
    for n in gpus:
        at = costs.at(n)
        unfit = at.unfit_s(step_s)
        latency = f"{at.decision_latency.value * 1e3:,.0f}" if at.decision_latency is not None else "-"
        lines.append(
            f"{n:>6,}  {at.plan_s:>8.2f}  {at.control_cpu_s * 1e3:>19,.1f}  "
            f"{(f'+{unfit * 1e3:,.0f} ms' if unfit else 'fits'):>15}  {latency:>25}  {_taken(at)}"
        )
    harness = f" of {costs.harness_step_s:g} s" if costs.harness_step_s else ""
    lines.append(
        f"decision: a measured step's report to its answer, median, on the harness's machine (steps{harness}); "
        "it measures that machine more than the design, so the model charges the CPU. By cluster MTBF (no GPU "
        "count) the costs are the bench's own."
    )
    return "\n".join(lines)


def _taken(at: ControlPlaneCost) -> str:
    plan, cpu = at.plan.describe(), at.control_cpu.describe()
    return plan if plan == cpu else f"plan {plan}, CPU {cpu}"
