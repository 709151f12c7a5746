"""The default checkpoint schedule: staggered, byte-budgeted, drift-aware periodic saves.

Every layer is saved periodically; the layers' phases are spread over the steps (largest first
into the least-loaded step, :mod:`layercheck.policies.schedule_phases`), so each step hands over a slice of
the model instead of a whole checkpoint every ``N`` steps.

One file because it is one schedule: the derivation below and the class that carries it out
(estimate each layer's drift rate, plan periods within the budget, place phases, save) share one
state, re-planned together; the phase placement itself is :mod:`~layercheck.policies.schedule_phases`.

**Periods.** Layer ``l`` has ``n_l`` parameters, ``b_l = 12 n_l`` bytes (fp32 weight and two Adam
moments) and drifts ``r_l`` per step (mean ``|Δθ|``, an online estimate: an exponential moving
average of its per-step drift). Saved every ``P_l`` steps, it writes ``b_l / P_l`` bytes per step
and, at a failure at a uniformly random step, loses on average ``n_l r_l P_l / 2`` of
parameter-weighted drift (a sawtooth). For a byte budget ``B`` per step, minimise
``D = Σ n_l r_l P_l / 2`` subject to ``Σ b_l / P_l = B``: with a multiplier ``λ``,
``n_l r_l / 2 = λ b_l / P_l²``, so ``P_l = sqrt(2 λ b_l / (n_l r_l)) = sqrt(24 λ / r_l)``, i.e.
``P_l = c / sqrt(r_l)`` with ``c = Σ b_l sqrt(r_l) / B`` from the budget (each term ``a/P + cP``
is convex, so this stationary point is the minimum). The budget is the changing layers' bytes /
``period`` (what "a full checkpoint every ``period`` steps" writes), lowered by
``max_bytes_per_step`` and by the writers' drain rate when the runtime passes it in
(:attr:`~layercheck.policies.decision.StepObservation.write_budget_bytes`; logged when it binds).

**Never worse than full checkpoints.** Full checkpoints every ``P`` steps are one point of the
problem above (every ``P_l = P``) at the same bytes, so the optimum loses no more drift at those
bytes; when every layer drifts alike (``r_l`` equal) the optimum *is* ``P_l = P`` — staggered
equal periods, which write exactly the full checkpoints' bytes and lose the same time-averaged
drift (each layer's sawtooth has the same mean whatever its phase), with a per-step peak of about
``1/P`` of a checkpoint (or the largest layer) instead of a whole one. What can cost a little:
integer periods, estimation error of ``r_l`` (re-planned only every mean period, and a layer's
period only when it moves by more than ``replan_tolerance``), and a run's ends. So drift-aware
periods are used only while their predicted gain over equal periods (:func:`predicted_gain`) is
at least ``min_gain``: where layers drift nearly alike the gain is within the estimate's noise,
and the schedule keeps staggered equal periods, exactly full checkpoints' bytes. ``drift_aware =
false`` always keeps equal periods, which minimise weighted *staleness* instead (``Σ n_l P_l / 2``).

**Frozen layers.** A layer whose drift since its last save is exactly 0 (frozen: no optimizer
state, so its saved version is exact) is not saved again, and does not count in the budget.

**Sampled drift.** The schedule needs each layer's drift *rate*, so the ranks measure drift only
every ``drift_every`` steps (:func:`~layercheck.policies.configs.drift_measured`: exact, that step's
update alone); an unmeasured step adds the layer's estimated rate to its unsaved drift, and each
measurement weighs in the estimate as the steps since the one before it would.

**The first period.** There is no whole-model base: from ``warmup_steps`` on, each layer's first
save lands at its phase within the first mean period. Until every layer has one there is no
composite to recover from: a failure then restarts from the initial weights (the supervisor
already does so). ``smax`` stays a hard backstop: a layer that changed and has gone ``smax``
steps unsaved is saved whatever the budget.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from typing import Any, ClassVar

from layercheck.policies.configs import StaggeredConfig
from layercheck.policies.decision import PersistDecision, PolicyView, Reason, StepObservation
from layercheck.policies.schedule_phases import Item, Recurring, horizon_for, load_table, place

logger = logging.getLogger(__name__)

#: Bytes persisted per parameter: fp32 weight + Adam exp_avg + exp_avg_sq.
BYTES_PER_PARAM = 12


def predicted_gain(weights: Mapping[str, float], size: Mapping[str, int]) -> float:
    """The fraction of unsaved drift that periods ``P_l ~ 1 / w_l`` (``w_l = sqrt(r_l)``) save
    over equal periods at the same bytes per step ``B``: drift-aware loses ``(Σ b w)² / B``,
    equal periods ``Σ b w² · Σ b / B`` (both up to the same constant), so the gain is
    ``1 - (Σ b w)² / (Σ b w² · Σ b)`` over the changing layers: 0 when every layer drifts alike
    and never negative (Cauchy–Schwarz)."""
    active = [n for n, w in weights.items() if w > 0]
    if not active:
        return 0.0
    bw = sum(size[n] * weights[n] for n in active)
    bw2 = sum(size[n] * weights[n] ** 2 for n in active)
    b = sum(size[n] for n in active)
    return max(0.0, 1.0 - bw * bw / (bw2 * b))


class StaggeredPolicy:
    """Staggered periodic saves (see the module docstring). ``rates`` fixes each layer's drift
    rate instead of estimating it online: the offline oracle (:mod:`layercheck.policies.simulation`)."""

    config_type: ClassVar[type] = StaggeredConfig

    @classmethod
    def from_config(cls, config: StaggeredConfig, numel: Mapping[str, int]) -> StaggeredPolicy:
        return cls(config, numel)

    def __init__(
        self, config: StaggeredConfig, numel: Mapping[str, int], *, rates: Mapping[str, float] | None = None
    ) -> None:
        if not numel:
            raise ValueError("StaggeredPolicy needs at least one layer")
        self.config = config
        self.layers = tuple(numel)
        self._known = frozenset(self.layers)
        self.size = {name: int(n) * BYTES_PER_PARAM for name, n in numel.items()}
        self.fixed_rates = None if rates is None else {name: float(rates.get(name, 0.0)) for name in self.layers}
        self._reset()

    def _reset(self) -> None:
        self.last_persisted: dict[str, int | None] = {name: None for name in self.layers}
        self.unsaved: dict[str, float] = {name: 0.0 for name in self.layers}
        self.rate: dict[str, float] = dict(self.fixed_rates or {name: 0.0 for name in self.layers})
        self.observed = 0  # steps seen by the rate estimate
        self.last_measured: int | None = None  # the step of the last measurement the rates took
        self.rate_weight = 1.0 if self.fixed_rates is not None else 0.0  # the EMA's total weight so far
        self.unknown: set[str] = set()  # layers whose drift since their last save is unknown
        self.period: dict[str, int | None] = {name: None for name in self.layers}
        self.due: dict[str, int | None] = {name: None for name in self.layers}
        self.unplaced: set[str] = set(self.layers)  # no first save scheduled yet
        self.budget: float | None = None  # bytes per step the plan is for
        self.mean_period = 1.0
        self.cap = 0  # the plan's heaviest step: saves beyond it wait a step
        self.next_replan: int | None = None
        self.external_budget: int | None = None
        self.external_binding = False  # whether the writers' drain rate set the plan's budget
        self.quiet_until = 0
        """Before this step nothing is due, stale or to re-plan: such a step decides nothing and,
        unless the budget moves, changes nothing but the drift estimates (see :meth:`observe`)."""

    # ---- deciding ------------------------------------------------------------------------
    def observe(self, obs: StepObservation) -> PersistDecision:
        if obs.drift and not self._known.issuperset(obs.drift):
            raise ValueError(f"drift reported for unknown layers {sorted(set(obs.drift) - self._known)}")
        self._track(obs)
        t = obs.step
        if t < self.config.warmup_steps:
            return PersistDecision(step=t)
        budget_moved = self._budget_moved(obs.write_budget_bytes)
        if t < self.quiet_until and not budget_moved:  # most steps: nothing to decide
            return PersistDecision(step=t)
        if self.budget is None or budget_moved:
            self._plan(t, every_layer=True)
        elif self.next_replan is not None and t >= self.next_replan:
            self._plan(t, every_layer=False)
        if self.unplaced:
            self._place(t)
        decision = self._persist(t, self._choose(t))
        self.quiet_until = self._next_event()
        return decision

    def decides_nothing_before(self, write_budget_bytes: int | None) -> int:
        """The first step whose observation, unmeasured and at this write budget, may decide
        something: every step before it decides nothing (and changes only the drift estimates).
        What lets the policy service know the steps between two measurements in advance."""
        warmup = self.config.warmup_steps
        if self._moves(self.external_budget, write_budget_bytes):
            return warmup
        return max(warmup, self.quiet_until)

    def _next_event(self) -> int:
        """The first step after this one where a save may be due (on schedule, or by the ``smax``
        backstop) or the plan is to be revisited; what the steps before it decide is known: nothing."""
        events = [d for d in self.due.values() if d is not None]
        events += [last + self.config.smax for last in self.last_persisted.values() if last is not None]
        if self.next_replan is not None:
            events.append(self.next_replan)
        return min(events, default=0)  # (every layer is placed by now)

    def _track(self, obs: StepObservation) -> None:
        """Each layer's unsaved drift and rate estimate. On a step with no measurement
        (``drift_every`` > 1) the unsaved drift grows by the layer's estimated rate (bias-corrected,
        as Adam corrects its moments): missing is not zero. Until a measurement at a non-zero
        learning rate has said how fast the layers move (a step at lr 0 moves nothing, frozen or
        not), an unmeasured step leaves each layer's drift *unknown*: never taken for frozen."""
        self.observed += 1
        if not obs.measured:
            if self.rate_weight > 0:
                weight, unsaved = self.rate_weight, self.unsaved
                for name, rate in self.rate.items():
                    unsaved[name] += rate / weight
            else:
                self.unknown.update(self.layers)
            return
        for name in self.layers:
            self.unsaved[name] += float(obs.drift.get(name, 0.0))
        if obs.lr == 0 or self.fixed_rates is not None:
            return  # (a step at lr 0 says nothing of a layer's rate)
        # a measurement stands for the steps since the one before it: the EMA's horizon in steps
        # is the same whether drift is measured every step or every drift_every-th
        gap = 1 if self.last_measured is None else max(1, obs.step - self.last_measured)
        self.last_measured = obs.step
        beta = self.config.ema**gap
        for name in self.layers:
            self.rate[name] = beta * self.rate[name] + (1 - beta) * float(obs.drift.get(name, 0.0))
        self.rate_weight = beta * self.rate_weight + (1 - beta)
        self.unknown.clear()  # a moving layer's unsaved drift is > 0 from here on, a frozen one's 0

    def _choose(self, t: int) -> dict[str, Reason]:
        reasons: dict[str, Reason] = {}
        handed = 0
        for name in self.layers:  # the hard backstop first, whatever the budget
            last = self.last_persisted[name]
            changed = self.unsaved[name] > 0 or name in self.unknown
            if last is not None and changed and t - last >= self.config.smax:
                reasons[name] = Reason.STALENESS
                handed += self.size[name]
        due = sorted(
            (d, -self.size[n], i, n)
            for i, n in enumerate(self.layers)
            if (d := self.due[n]) is not None and d <= t and n not in reasons
        )
        for due_at, _, _, name in due:
            if self.last_persisted[name] is not None and self.unsaved[name] == 0.0 and name not in self.unknown:
                self._advance(name, t)  # unchanged since its last save (frozen): its version is exact
                continue
            late = t - due_at >= (self.period[name] or 1)
            if handed and handed + self.size[name] > self.cap and not late:
                continue  # over the plan's peak (a rare coincidence, or catching up): next step
            reasons[name] = Reason.SCHEDULE
            handed += self.size[name]
        return reasons

    def _persist(self, t: int, reasons: Mapping[str, Reason]) -> PersistDecision:
        for name in reasons:
            self.last_persisted[name] = t
            self.unsaved[name] = 0.0
            self.unknown.discard(name)
            self._advance(name, t)
        if reasons:
            logger.debug("step %d: persist %s", t, {n: r.value for n, r in reasons.items()})
        return PersistDecision.of(t, {name: reasons[name] for name in self.layers if name in reasons})

    def _advance(self, name: str, t: int) -> None:
        """Next save of ``name``: one period after the one just due, keeping its phase (one
        period from now if it was saved early, by the backstop, or fell a period behind)."""
        period, due = self.period[name], self.due[name]
        if period is None or due is None:
            self.due[name] = None
            return
        due += period
        self.due[name] = due if t < due <= t + period else t + period

    # ---- planning ------------------------------------------------------------------------
    def _budget_moved(self, external: int | None) -> bool:
        moved = self._moves(self.external_budget, external)
        self.external_budget = external
        return moved

    def _moves(self, previous: int | None, external: int | None) -> bool:
        """Whether the writers' drain rate moved enough to re-plan: any drop below the plan (or
        the queue would grow without bound), a rise beyond the tolerance."""
        if external is None or self.budget is None:
            return previous is not None and external is None
        rose = self.external_binding and external > self.budget * self.config.replan_tolerance
        return external < self.budget or rose

    def _weights(self) -> dict[str, float]:
        """Each layer's ``sqrt(r_l)`` (1 for every changing layer when not drift-aware); 0 for
        a layer that has not moved. Until the estimate has seen one EMA horizon, every layer
        counts as changing at the same pace."""
        horizon = 1 / (1 - self.config.ema) if self.config.ema else 1
        if self.fixed_rates is None and self.observed < horizon:
            return {name: 1.0 for name in self.layers}
        changing = {name: r for name, r in self.rate.items() if r > 0}
        weights = {name: math.sqrt(changing[name]) if name in changing else 0.0 for name in self.layers}
        if not self.config.drift_aware or predicted_gain(weights, self.size) < self.config.min_gain:
            return {name: 1.0 if name in changing else 0.0 for name in self.layers}
        return weights

    def _budget(self, active_bytes: int) -> float:
        limits = [active_bytes / self.config.period] if self.config.period is not None else []
        if self.config.max_bytes_per_step is not None:
            limits.append(float(self.config.max_bytes_per_step))
        configured = min(limits)
        external = self.external_budget
        self.external_binding = external is not None and external < configured
        if external is not None and self.external_binding:
            logger.info(
                "write budget %d B/step (the writers' drain rate) is below the schedule's %.0f B/step: "
                "periods stretch %.2fx",
                external,
                configured,
                configured / max(1, external),
            )
            return float(max(1, external))
        return configured

    def _periods(self, weights: Mapping[str, float], budget: float) -> dict[str, int | None]:
        """``P_l = c / w_l`` rounded, ``c`` set so the saves fit ``budget`` (clamped to ``smax``)."""
        active = [n for n in self.layers if weights[n] > 0]
        c = sum(self.size[n] * weights[n] for n in active) / budget
        saved: dict[str, int] = {}
        for _ in range(8):  # rounding may overshoot the budget a little: widen until it fits
            saved = {n: min(self.config.smax, max(1, round(c / weights[n]))) for n in active}
            spent = sum(self.size[n] / saved[n] for n in active)
            if spent <= budget * (1 + 1e-9) or all(saved[n] == self.config.smax for n in active):
                break
            c *= spent / budget
        return {n: saved.get(n) for n in self.layers}

    def _plan(self, t: int, *, every_layer: bool) -> None:
        weights = self._weights()
        active_bytes = sum(self.size[n] for n in self.layers if weights[n] > 0)
        if not active_bytes:  # nothing has moved yet: plan as if every layer were
            weights = {name: 1.0 for name in self.layers}
            active_bytes = sum(self.size.values())
        budget = self._budget(active_bytes)
        periods = self._periods(weights, budget)
        tolerance = self.config.replan_tolerance
        changed = []
        for name, new in periods.items():
            old = self.period[name]
            if old == new or (
                not every_layer and old is not None and new is not None and max(old, new) <= min(old, new) * tolerance
            ):
                continue
            self.period[name] = new
            changed.append(name)
            if new is None:
                if self.last_persisted[name] is not None:  # else its first save stays due, once
                    self.due[name] = None
            else:
                self.unplaced.add(name)  # a new phase, about one new period after its last save
        self.budget = budget
        self.mean_period = active_bytes / budget
        self.next_replan = t + max(1, math.ceil(self.mean_period))
        if self.config.smax < self.mean_period and self.fixed_rates is None:  # the oracle sweeps past it on purpose
            logger.warning(
                "budget %.0f B/step needs a mean period of %.0f steps, beyond smax=%d: smax wins",
                budget,
                self.mean_period,
                self.config.smax,
            )
        self.cap = self._cap(weights)
        if changed:
            logger.log(
                logging.INFO if self.fixed_rates is None else logging.DEBUG,  # the oracle's sweep replans often
                "step %d: planned %d B/step (mean period %.1f steps); periods of %d layer(s) changed",
                t,
                round(budget),
                self.mean_period,
                len(changed),
            )

    def _place(self, t: int) -> None:
        """Phase every unplaced layer on the least-loaded steps: a first save within one mean
        period from ``t`` (its own period, if shorter; evenly over it with ``spread_phases``); a
        layer with a version and a new period (a re-plan) as early as the load allows from half of
        that period after its last save."""
        window = max(1, min(math.ceil(self.mean_period), self.config.smax))
        scheduled = {
            n: Recurring(size=self.size[n], due=d, period=self.period[n])
            for n in self.layers
            if (d := self.due[n]) is not None and n not in self.unplaced
        }
        items = []
        for n in self.layers:
            if n not in self.unplaced:
                continue
            period, last = self.period[n], self.last_persisted[n]
            if last is None or period is None:
                spread = self.config.spread_phases
                items.append(
                    Item(name=n, size=self.size[n], period=period, window=min(window, period or window), spread=spread)
                )
            else:
                items.append(
                    Item(name=n, size=self.size[n], period=period, window=period, offset=max(0, last + period // 2 - t))
                )
        horizon = horizon_for([*self.period.values(), *(i.offset + i.window for i in items)], window)
        self.due.update(place(items, load_table(scheduled, start=t, horizon=horizon), start=t))
        self.unplaced.clear()

    def _cap(self, weights: Mapping[str, float]) -> int:
        """Bytes one step may hand over: what staggered equal periods at the mean period would
        peak at (LPT), and no less than the budget or the largest layer. Saves due beyond it wait
        a step (coincidences of unequal periods, catching up after a recovery)."""
        sizes = {n: self.size[n] for n in self.layers if weights[n] > 0} or self.size
        period = max(1, min(round(self.mean_period), len(sizes)))
        load = [0] * period
        for size in sorted(sizes.values(), reverse=True):
            load[load.index(min(load))] += size
        return max(max(load), math.ceil(self.budget or 0), max(sizes.values()))

    # ---- recovery and state --------------------------------------------------------------
    def rebase(self, persisted_steps: Mapping[str, int]) -> None:
        """A recovery loaded these versions: the schedule continues from them (a layer's next
        save one period after its loaded version, keeping its phase; a layer with none gets a
        first save again). With no version at all, training restarts from the initial weights
        and so does the schedule."""
        if not any(persisted_steps.get(name) is not None for name in self.layers):
            rates, observed, measured, weight = self.rate, self.observed, self.last_measured, self.rate_weight
            self._reset()
            self.rate, self.observed, self.last_measured, self.rate_weight = rates, observed, measured, weight
            return
        self.quiet_until = 0  # the saves and phases below move
        for name in self.layers:
            step = persisted_steps.get(name)
            self.last_persisted[name] = step
            self.unsaved[name] = 0.0  # the live weights are the loaded version now
            self.unknown.discard(name)
            period = self.period[name]
            if step is None:
                self.unplaced.add(name)
            elif period is not None:
                self.due[name] = step + period

    def metrics_view(self, lr: float) -> PolicyView:
        """Its staleness backstop and drift since each layer's last save (the dashboards' view;
        estimated between measurements when ``drift_every`` > 1)."""
        return {"smax": self.config.smax, "accumulated": dict(self.unsaved)}

    def state_dict(self) -> dict[str, object]:
        return {
            "last_persisted": dict(self.last_persisted),
            "unsaved": dict(self.unsaved),
            "rate": dict(self.rate),
            "observed": self.observed,
            "last_measured": self.last_measured,
            "rate_weight": self.rate_weight,
            "unknown": sorted(self.unknown),
            "period": dict(self.period),
            "due": dict(self.due),
            "unplaced": sorted(self.unplaced),
            "budget": self.budget,
            "mean_period": self.mean_period,
            "cap": self.cap,
            "next_replan": self.next_replan,
            "external_budget": self.external_budget,
            "external_binding": self.external_binding,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if set(state["last_persisted"]) != set(self.layers):
            raise ValueError(
                f"policy state is for layers {sorted(state['last_persisted'])}, this policy has {sorted(self.layers)}"
            )

        def opt_int(value: Any) -> int | None:
            return None if value is None else int(value)

        self.last_persisted = {n: opt_int(state["last_persisted"][n]) for n in self.layers}
        self.unsaved = {n: float(state["unsaved"][n]) for n in self.layers}
        if self.fixed_rates is None:
            self.rate = {n: float(state["rate"][n]) for n in self.layers}
        self.observed = int(state["observed"])
        # (absent from states before drift_every: their rates came from a measurement every step)
        self.last_measured = opt_int(state.get("last_measured"))
        if self.fixed_rates is None:
            self.rate_weight = float(state.get("rate_weight", 1.0))
        self.unknown = set(state.get("unknown", ()))
        self.period = {n: opt_int(state["period"][n]) for n in self.layers}
        self.due = {n: opt_int(state["due"][n]) for n in self.layers}
        self.unplaced = set(state["unplaced"])
        self.budget = None if state["budget"] is None else float(state["budget"])
        self.mean_period = float(state["mean_period"])
        self.cap = int(state["cap"])
        self.next_replan = opt_int(state["next_replan"])
        self.external_budget = opt_int(state["external_budget"])
        self.external_binding = bool(state["external_binding"])
        self.quiet_until = 0
