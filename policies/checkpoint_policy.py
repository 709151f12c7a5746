"""Checkpoint policies: after each optimizer step, which layers to persist.

A policy is a small state machine over values: :meth:`observe` takes a
:class:`~layercheck.policies.decision.StepObservation` and returns a
:class:`~layercheck.policies.decision.PersistDecision`. It never blocks, talks to other ranks or touches
storage; the caller agrees the observation across ranks first and carries the decision out.
Its state is plain JSON (:meth:`state_dict`), so a recovered run continues the same policy, and
:meth:`rebase` points it at the versions a recovery actually loaded.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, Protocol, runtime_checkable

from layercheck.policies.config_loader import require
from layercheck.policies.configs import (
    POLICY_CONFIGS,
    DriftOptimalConfig,
    IntervalConfig,
    LayerCheckConfig,
    NeverConfig,
    PolicyConfig,
    policy_name,
)
from layercheck.policies.decision import PersistDecision, PolicyView, Reason, StepObservation
from layercheck.policies.layer_map import EMBED
from layercheck.policies.staggered import StaggeredPolicy

logger = logging.getLogger(__name__)


class CheckpointPolicy(Protocol):
    """The interface every policy, LayerCheck's and the baselines', shares."""

    def observe(self, obs: StepObservation) -> PersistDecision: ...

    def rebase(self, persisted_steps: Mapping[str, int]) -> None:
        """A recovery loaded, per layer, the version taken at ``persisted_steps[layer]``: count
        staleness and drift from there (decisions not committed before the failure are lost)."""

    def state_dict(self) -> dict[str, object]: ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...

    def metrics_view(self, lr: float) -> PolicyView:
        """What the run's metrics show of this policy at learning rate ``lr`` (read-only), each key
        optional: ``smax`` (the staleness budget, in steps), ``accumulated`` and ``threshold``
        (per layer: drift since the last save, and the drift that triggers the next)."""


@runtime_checkable
class KnowsQuietSteps(Protocol):
    """The optional part of a policy measured only every ``drift_every`` steps (``staggered``)
    that can tell, without observing them, which of the unmeasured steps ahead decide nothing."""

    def decides_nothing_before(self, write_budget_bytes: int | None) -> int:
        """The first step whose observation, unmeasured and at this write budget, may decide
        something; every step before it decides nothing."""


class DriftThresholdPolicy:
    """What LayerCheck and drift-optimal share: nothing before the warm-up step, then the base
    (every layer); afterwards a layer is persisted once its drift accumulated since its last
    save reaches :meth:`threshold`, or once it has gone ``smax`` steps unsaved."""

    def __init__(self, layers: Sequence[str], *, warmup_steps: int, smax: int) -> None:
        if not layers:
            raise ValueError(f"{type(self).__name__} needs at least one layer")
        self.layers = tuple(layers)
        self.warmup_steps = warmup_steps
        self.smax = smax
        self.accumulated: dict[str, float] = {name: 0.0 for name in self.layers}
        self.last_persisted: dict[str, int | None] = {name: None for name in self.layers}
        self.base_step: int | None = None

    def threshold(self, layer: str, lr: float) -> float:
        raise NotImplementedError(f"{type(self).__name__} must define threshold()")

    def staleness(self, step: int) -> dict[str, int | None]:
        """Steps since each layer was last persisted (``None`` before the base)."""
        return {name: None if last is None else step - last for name, last in self.last_persisted.items()}

    def observe(self, obs: StepObservation) -> PersistDecision:
        unknown = set(obs.drift) - set(self.layers)
        if unknown:
            raise ValueError(f"drift reported for unknown layers {sorted(unknown)}")
        if not obs.measured and not obs.drift:  # (a replay's estimate of an unmeasured step will do)
            raise ValueError(
                f"step {obs.step}: no drift measured, but {type(self).__name__} decides on every step's "
                "drift (its config's drift_every is 1)"
            )
        if self.base_step is None:
            if obs.step < self.warmup_steps:
                return PersistDecision(step=obs.step)
            logger.info(
                "step %d: base checkpoint of all %d layers (warmup_steps=%d)",
                obs.step,
                len(self.layers),
                self.warmup_steps,
            )
            self.base_step = obs.step
            return self._persist(obs.step, {name: Reason.BASE for name in self.layers})
        reasons: dict[str, Reason] = {}
        for name in self.layers:
            self.accumulated[name] += float(obs.drift.get(name, 0.0))
            last = self.last_persisted[name]
            assert last is not None
            if self.accumulated[name] > 0 and self.accumulated[name] >= self.threshold(name, obs.lr):
                reasons[name] = Reason.DRIFT
            elif obs.step - last >= self.smax:
                reasons[name] = Reason.STALENESS
        if reasons:
            logger.debug("step %d: persist %s", obs.step, {n: r.value for n, r in reasons.items()})
        return self._persist(obs.step, reasons)

    def _persist(self, step: int, reasons: Mapping[str, Reason]) -> PersistDecision:
        for name in reasons:
            self.accumulated[name] = 0.0
            self.last_persisted[name] = step
        return PersistDecision.of(step, reasons)

    def rebase(self, persisted_steps: Mapping[str, int]) -> None:
        self.accumulated = {name: 0.0 for name in self.layers}
        self.last_persisted = {name: persisted_steps.get(name) for name in self.layers}
        if any(step is None for step in self.last_persisted.values()):
            self.base_step = None  # no committed version of some layer: write the base again

    def state_dict(self) -> dict[str, object]:
        return {
            "accumulated": dict(self.accumulated),
            "last_persisted": dict(self.last_persisted),
            "base_step": self.base_step,
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

    def metrics_view(self, lr: float) -> PolicyView:
        return {
            "smax": self.smax,
            "accumulated": dict(self.accumulated),
            "threshold": {name: self.threshold(name, lr) for name in self.layers},
        }


class LayerCheckPolicy(DriftThresholdPolicy):
    """The paper's policy (docs/schedules.md): threshold ``K0 * s(lr_t)``, ``K0`` of its own for the
    embedding, ``s`` following the learning-rate schedule or constant."""

    config_type: ClassVar[type] = LayerCheckConfig

    @classmethod
    def from_config(cls, config: LayerCheckConfig, numel: Mapping[str, int]) -> LayerCheckPolicy:
        return cls(config, list(numel))

    def __init__(self, config: LayerCheckConfig, layers: Sequence[str]) -> None:
        super().__init__(layers, warmup_steps=config.warmup_steps, smax=config.smax)
        self.config = config
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

    def observe(self, obs: StepObservation) -> PersistDecision:
        self.lr_peak_seen = max(self.lr_peak_seen, obs.lr)
        return super().observe(obs)

    def state_dict(self) -> dict[str, object]:
        return {**super().state_dict(), "lr_peak_seen": self.lr_peak_seen}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)
        self.lr_peak_seen = float(state["lr_peak_seen"])


class DriftOptimalPolicy(DriftThresholdPolicy):
    """Save periods proportional to ``1 / sqrt(drift rate)``.

    A layer drifting at rate ``d_l`` saved every ``P_l`` steps loses on average
    ``n_l * d_l * P_l / 2`` of parameter-weighted drift at a failure and writes ``n_l / P_l``
    per step; minimising the first for a given sum of the second (Lagrange) gives
    ``P_l ∝ 1 / sqrt(d_l)``: fast layers are saved more often, but less aggressively than
    LayerCheck's ``1 / d_l``. Layer ``l`` is saved when its accumulated drift reaches
    ``period * sqrt(r_l * r_mean)`` — ``r_l`` a moving average of its drift rate, ``r_mean`` the
    parameter-weighted mean — so a layer at the mean rate is saved every ``period`` steps.
    """

    config_type: ClassVar[type] = DriftOptimalConfig

    @classmethod
    def from_config(cls, config: DriftOptimalConfig, numel: Mapping[str, int]) -> DriftOptimalPolicy:
        return cls(config, numel)

    def __init__(self, config: DriftOptimalConfig, numel: Mapping[str, int]) -> None:
        super().__init__(list(numel), warmup_steps=config.warmup_steps, smax=config.smax)
        self.config = config
        self.numel = dict(numel)
        self.rate: dict[str, float | None] = {name: None for name in self.layers}

    def threshold(self, layer: str, lr: float) -> float:
        rates = {name: rate or 0.0 for name, rate in self.rate.items()}
        mean = sum(self.numel[n] * r for n, r in rates.items()) / sum(self.numel.values())
        return self.config.period * math.sqrt(max(rates[layer], 0.0) * mean)

    def observe(self, obs: StepObservation) -> PersistDecision:
        beta = self.config.ema
        for name in self.layers:
            drift = float(obs.drift.get(name, 0.0))
            previous = self.rate[name]
            self.rate[name] = drift if previous is None else beta * previous + (1 - beta) * drift
        return super().observe(obs)

    def state_dict(self) -> dict[str, object]:
        return {**super().state_dict(), "rate": dict(self.rate)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)
        self.rate = {name: None if state["rate"][name] is None else float(state["rate"][name]) for name in self.layers}


class IntervalPolicy:
    """Every layer at every multiple of ``interval``: a fixed-interval full checkpoint."""

    config_type: ClassVar[type] = IntervalConfig

    @classmethod
    def from_config(cls, config: IntervalConfig, numel: Mapping[str, int]) -> IntervalPolicy:
        return cls(config, list(numel))

    def __init__(self, config: IntervalConfig, layers: Sequence[str]) -> None:
        self.config = config
        self.layers = tuple(layers)

    def observe(self, obs: StepObservation) -> PersistDecision:
        if obs.step > 0 and obs.step % self.config.interval == 0:
            return PersistDecision.of(obs.step, {name: Reason.INTERVAL for name in self.layers})
        return PersistDecision(step=obs.step)

    def rebase(self, persisted_steps: Mapping[str, int]) -> None:
        pass  # the schedule depends on the step alone

    def state_dict(self) -> dict[str, object]:
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        pass

    def metrics_view(self, lr: float) -> PolicyView:
        return {"smax": self.config.interval}  # no layer waits longer than one interval


class NeverPolicy:
    """Never persists anything."""

    config_type: ClassVar[type] = NeverConfig

    @classmethod
    def from_config(cls, config: NeverConfig, numel: Mapping[str, int]) -> NeverPolicy:
        return cls(config, list(numel))

    def __init__(self, config: NeverConfig, layers: Sequence[str]) -> None:
        self.config = config
        self.layers = tuple(layers)

    def observe(self, obs: StepObservation) -> PersistDecision:
        return PersistDecision(step=obs.step)

    def rebase(self, persisted_steps: Mapping[str, int]) -> None:
        pass

    def state_dict(self) -> dict[str, object]:
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        pass

    def metrics_view(self, lr: float) -> PolicyView:
        return {}


class PolicyType(Protocol):
    """A policy class as the registry holds it (the class object itself is one): the config class
    it is built from and the constructor from that config (``config`` is that class's instance)."""

    @property
    def config_type(self) -> type: ...

    def from_config(self, config: Any, numel: Mapping[str, int]) -> CheckpointPolicy: ...


#: The second half of the registry: config class → policy class (``POLICY_CONFIGS`` in
#: :mod:`layercheck.policies.configs` is the first, name → config class). A new policy adds its config there
#: and its class here, with ``config_type`` and ``from_config``; nothing else switches on the type.
POLICY_TYPES: dict[type, PolicyType] = {
    cls.config_type: cls for cls in (StaggeredPolicy, LayerCheckPolicy, DriftOptimalPolicy, IntervalPolicy, NeverPolicy)
}


def policy_type(name: str) -> PolicyType:
    """The policy class registered under ``name``; an unknown name is a ConfigError listing the known ones."""
    require(name in POLICY_CONFIGS, "policy.name", f"one of {sorted(POLICY_CONFIGS)}", name)
    return POLICY_TYPES[POLICY_CONFIGS[name]]


def build_policy(config: PolicyConfig, numel: Mapping[str, int]) -> CheckpointPolicy:
    """The policy a config describes, over the layers of ``numel`` (model order → parameters)."""
    return policy_type(policy_name(config)).from_config(config, numel)
