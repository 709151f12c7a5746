"""A drift-optimal layer-wise policy, benchmarked as its own strategy (``drift-optimal``).

LayerCheck saves a layer when its accumulated drift reaches a threshold, so a layer drifting at
rate ``d`` is saved every ``K / d`` steps. For the freshness measure that counts drift — the
parameter-weighted drift a failure loses, ``sum(n_l * d_l * P_l) / 2`` for save periods ``P_l`` —
at a given write rate ``sum(n_l / P_l)``, the optimum (Lagrange) is ``P_l ∝ 1 / sqrt(d_l)``:
save fast layers more often than slow ones, but less aggressively than ``1 / d``. This policy
does that: layer ``l`` is saved when its accumulated drift reaches ``period * sqrt(r_l * r_mean)``,
with ``r_l`` an exponential moving average of its per-step drift and ``r_mean`` the
parameter-weighted mean, so a layer drifting at the mean rate is saved every ``period`` steps
(the knob users know from full checkpoints). Warm-up, base checkpoint and the ``Smax`` backstop
are LayerCheck's. Pure, with the same interface as the project's policies.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from policies.decision import PersistDecision, Reason, StepObservation


@dataclass(frozen=True, kw_only=True)
class DriftOptimalConfig:
    period: int = 50
    """Save period of a layer drifting at the parameter-weighted mean rate."""
    warmup_steps: int = 200
    smax: int = 1000
    ema: float = 0.9
    """Smoothing of each layer's per-step drift rate."""

    def __post_init__(self) -> None:
        if self.period < 1:
            raise ValueError(f"DriftOptimalConfig.period: must be >= 1, got {self.period}")
        if self.warmup_steps < 0 or self.smax < 1:
            raise ValueError("DriftOptimalConfig: warmup_steps >= 0 and smax >= 1")
        if not 0 <= self.ema < 1:
            raise ValueError(f"DriftOptimalConfig.ema: must be in [0, 1), got {self.ema}")

    def to_json(self) -> dict[str, Any]:
        return {"type": "drift-optimal", **asdict(self)}


class DriftOptimalPolicy:
    def __init__(self, config: DriftOptimalConfig, numel: Mapping[str, int]) -> None:
        self.config = config
        self.numel = dict(numel)
        self.total = sum(self.numel.values())
        self.rate: dict[str, float | None] = {name: None for name in numel}
        self.accumulated = {name: 0.0 for name in numel}
        self.last_persisted: dict[str, int | None] = {name: None for name in numel}
        self.base_step: int | None = None

    def threshold(self, layer: str) -> float:
        rates = {n: r or 0.0 for n, r in self.rate.items()}
        mean = sum(self.numel[n] * r for n, r in rates.items()) / self.total
        return self.config.period * math.sqrt(max(rates[layer], 0.0) * mean)

    def observe(self, obs: StepObservation) -> PersistDecision:
        beta = self.config.ema
        for name in self.numel:
            d = float(obs.drift.get(name, 0.0))
            previous = self.rate[name]
            self.rate[name] = d if previous is None else beta * previous + (1 - beta) * d
        if self.base_step is None:
            if obs.step < self.config.warmup_steps:
                return PersistDecision(step=obs.step)
            self.base_step = obs.step
            return self._persist(obs.step, {name: Reason.BASE for name in self.numel})
        reasons: dict[str, Reason] = {}
        for name in self.numel:
            self.accumulated[name] += float(obs.drift.get(name, 0.0))
            last = self.last_persisted[name]
            if self.accumulated[name] > 0 and self.accumulated[name] >= self.threshold(name):  # 0 drift: no save
                reasons[name] = Reason.DRIFT
            elif last is None or obs.step - last >= self.config.smax:
                reasons[name] = Reason.STALENESS
        return self._persist(obs.step, reasons)

    def _persist(self, step: int, reasons: Mapping[str, Reason]) -> PersistDecision:
        for name in reasons:
            self.accumulated[name] = 0.0
            self.last_persisted[name] = step
        return PersistDecision.of(step, reasons)

    def state_dict(self) -> dict[str, Any]:
        return {"rate": dict(self.rate), "accumulated": dict(self.accumulated),
                "last_persisted": dict(self.last_persisted), "base_step": self.base_step}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.rate = dict(state["rate"])
        self.accumulated = {k: float(v) for k, v in state["accumulated"].items()}
        self.last_persisted = dict(state["last_persisted"])
        self.base_step = state["base_step"]
