"""Checkpoint policies: after each optimizer step, which layers to persist.

A policy is a small state machine over values: :meth:`observe` takes a
:class:`~policies.decision.StepObservation` and returns a
:class:`~policies.decision.PersistDecision`. It never blocks, talks to other ranks or touches
storage; the caller agrees the observation across ranks first and carries the decision out.
Its state is plain JSON (:meth:`state_dict`), so a recovered run continues the same policy.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from policies.configs import IntervalConfig, LayerCheckConfig, NeverConfig, PolicyConfig
from policies.decision import PersistDecision, Reason, StepObservation
from policies.layer_map import EMBED

logger = logging.getLogger(__name__)


class CheckpointPolicy(Protocol):
    """The interface every policy, LayerCheck's and the baselines', shares."""

    def observe(self, obs: StepObservation) -> PersistDecision: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...


class LayerCheckPolicy:
    """Persist a layer when its accumulated drift reaches ``K0 * s(lr_t)`` or its staleness
    reaches ``Smax``; before step ``W`` nothing, at ``W`` the full base (DESIGN.md)."""

    def __init__(self, config: LayerCheckConfig, layers: Sequence[str]) -> None:
        if not layers:
            raise ValueError("LayerCheckPolicy needs at least one layer")
        self.config = config
        self.layers = tuple(layers)
        self.accumulated: dict[str, float] = {name: 0.0 for name in self.layers}
        self.last_persisted: dict[str, int | None] = {name: None for name in self.layers}
        self.base_step: int | None = None
        self.lr_peak_seen = 0.0

    def k0(self, layer: str) -> float:
        return self.config.k0_embed if layer == EMBED else self.config.k0

    def lr_scale(self, lr: float) -> float:
        """``s(lr_t)``: 1 for the constant schedule; ``lr_t / lr_peak`` floored otherwise."""
        if self.config.threshold_schedule == "constant":
            return 1.0
        peak = self.config.lr_peak if self.config.lr_peak is not None else max(self.lr_peak_seen, lr)
        if peak <= 0:
            return self.config.min_lr_scale
        return max(lr / peak, self.config.min_lr_scale)

    def threshold(self, layer: str, lr: float) -> float:
        return self.k0(layer) * self.lr_scale(lr)

    def staleness(self, step: int) -> dict[str, int | None]:
        """Steps since each layer was last persisted (``None`` before the base)."""
        return {
            name: None if last is None else step - last for name, last in self.last_persisted.items()
        }

    def observe(self, obs: StepObservation) -> PersistDecision:
        unknown = set(obs.drift) - set(self.layers)
        if unknown:
            raise ValueError(f"drift reported for unknown layers {sorted(unknown)}")
        self.lr_peak_seen = max(self.lr_peak_seen, obs.lr)
        if self.base_step is None:
            if obs.step < self.config.warmup_steps:
                return PersistDecision(step=obs.step)
            logger.info("step %d: base checkpoint of all %d layers (warmup_steps=%d)",
                        obs.step, len(self.layers), self.config.warmup_steps)
            self.base_step = obs.step
            return self._persist(obs.step, {name: Reason.BASE for name in self.layers})
        reasons: dict[str, Reason] = {}
        for name in self.layers:
            self.accumulated[name] += float(obs.drift.get(name, 0.0))
            last = self.last_persisted[name]
            assert last is not None
            if self.accumulated[name] >= self.threshold(name, obs.lr):
                reasons[name] = Reason.DRIFT
            elif obs.step - last >= self.config.smax:
                reasons[name] = Reason.STALENESS
        if reasons:
            logger.debug("step %d: persist %s", obs.step, {n: r.value for n, r in reasons.items()})
        return self._persist(obs.step, reasons)

    def _persist(self, step: int, reasons: Mapping[str, Reason]) -> PersistDecision:
        for name in reasons:
            self.accumulated[name] = 0.0
            self.last_persisted[name] = step
        return PersistDecision.of(step, reasons)

    def state_dict(self) -> dict[str, Any]:
        return {
            "accumulated": dict(self.accumulated),
            "last_persisted": dict(self.last_persisted),
            "base_step": self.base_step,
            "lr_peak_seen": self.lr_peak_seen,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if set(state["accumulated"]) != set(self.layers):
            raise ValueError(
                f"policy state is for layers {sorted(state['accumulated'])}, this policy has {sorted(self.layers)}"
            )
        self.accumulated = {name: float(state["accumulated"][name]) for name in self.layers}
        self.last_persisted = {
            name: None if state["last_persisted"][name] is None else int(state["last_persisted"][name])
            for name in self.layers
        }
        self.base_step = None if state["base_step"] is None else int(state["base_step"])
        self.lr_peak_seen = float(state["lr_peak_seen"])


class IntervalPolicy:
    """Every layer at every multiple of ``interval``: a fixed-interval full checkpoint."""

    def __init__(self, config: IntervalConfig, layers: Sequence[str]) -> None:
        self.config = config
        self.layers = tuple(layers)

    def observe(self, obs: StepObservation) -> PersistDecision:
        if obs.step > 0 and obs.step % self.config.interval == 0:
            return PersistDecision.of(obs.step, {name: Reason.INTERVAL for name in self.layers})
        return PersistDecision(step=obs.step)

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        pass


class NeverPolicy:
    """Never persists anything."""

    def __init__(self, config: NeverConfig, layers: Sequence[str]) -> None:
        self.config = config
        self.layers = tuple(layers)

    def observe(self, obs: StepObservation) -> PersistDecision:
        return PersistDecision(step=obs.step)

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        pass


def build_policy(config: PolicyConfig, layers: Sequence[str]) -> CheckpointPolicy:
    """The policy a config describes, over the given layers (model order)."""
    if isinstance(config, LayerCheckConfig):
        return LayerCheckPolicy(config, layers)
    if isinstance(config, IntervalConfig):
        return IntervalPolicy(config, layers)
    if isinstance(config, NeverConfig):
        return NeverPolicy(config, layers)
    raise TypeError(f"not a policy config: {config!r}")
