"""The checkpoint policies' configs and their registry by name.

Every config is a frozen ``kw_only`` dataclass validated in ``__post_init__``; a bad value
raises :class:`~layercheck.policies.config_loader.ConfigError` naming the field and what is allowed.
``POLICY_CONFIGS`` (name → config class) is one half of the policy registry; the other half,
config class → policy class, is ``POLICY_TYPES`` in :mod:`layercheck.policies.checkpoint_policy`. What the
callers need to know about a policy (is it selective? what is its label?) is asked of the config,
never switched on its type.
"""

from __future__ import annotations

import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from layercheck.policies.config_loader import from_mapping, require, require_finite

ThresholdSchedule = Literal["lr", "constant"]
THRESHOLD_SCHEDULES: tuple[str, ...] = typing.get_args(ThresholdSchedule)


@dataclass(frozen=True, kw_only=True)
class LayerCheckConfig:
    """The paper's adaptive policy (docs/schedules.md, "The paper's policy, exactly")."""

    selective: ClassVar[bool] = True
    """Chooses layers by drift after a warm-up: compared with full checkpoints at matched freshness."""
    drift_every: ClassVar[int] = 1
    """Steps between drift measurements: a threshold decides at every step, so it measures every step."""

    k0: float = 1e-3
    """Base drift threshold for every layer but the embeddings."""
    k0_embed: float = 1e-2
    """Base drift threshold for the ``embed`` layer, which drifts in sparse bursts."""
    smax: int = 1000
    """Staleness budget: a layer unsaved for this many steps is persisted whatever its drift."""
    warmup_steps: int = 200
    """No selective persistence before this step; the full base checkpoint is written at it."""
    threshold_schedule: ThresholdSchedule = "lr"
    """``lr``: threshold ``K0 * lr_t / lr_peak`` follows the LR schedule; ``constant``: ``K0``."""
    lr_peak: float | None = None
    """The schedule's peak learning rate; ``None`` uses the largest learning rate seen so far."""
    min_lr_scale: float = 0.01
    """Floor of ``lr_t / lr_peak``, so a zero learning rate never makes the threshold zero."""

    def __post_init__(self) -> None:
        require_finite(self)
        require(self.k0 > 0, "k0", "> 0", self.k0)
        require(self.k0_embed > 0, "k0_embed", "> 0", self.k0_embed)
        require(self.smax >= 1, "smax", ">= 1", self.smax)
        require(self.warmup_steps >= 0, "warmup_steps", ">= 0", self.warmup_steps)
        require(
            self.threshold_schedule in THRESHOLD_SCHEDULES,
            "threshold_schedule",
            f"one of {list(THRESHOLD_SCHEDULES)}",
            self.threshold_schedule,
        )
        require(self.lr_peak is None or self.lr_peak > 0, "lr_peak", "None or > 0", self.lr_peak)
        require(0 < self.min_lr_scale <= 1, "min_lr_scale", "in (0, 1]", self.min_lr_scale)

    def describe(self) -> str:
        return f"layercheck k0={self.k0:g}"


@dataclass(frozen=True, kw_only=True)
class DriftOptimalConfig:
    """Per-layer save periods proportional to 1/sqrt(drift rate): for a given write rate, the
    schedule that minimises the parameter-weighted drift a failure loses (see
    :class:`layercheck.policies.checkpoint_policy.DriftOptimalPolicy`)."""

    selective: ClassVar[bool] = True
    drift_every: ClassVar[int] = 1

    period: int = 50
    """Save period of a layer drifting at the parameter-weighted mean rate."""
    warmup_steps: int = 200
    """No selective persistence before this step; the full base checkpoint is written at it."""
    smax: int = 1000
    """Staleness budget, as for LayerCheck."""
    ema: float = 0.9
    """Smoothing of each layer's per-step drift rate (exponential moving average)."""

    def __post_init__(self) -> None:
        require_finite(self)
        require(self.period >= 1, "period", ">= 1", self.period)
        require(self.warmup_steps >= 0, "warmup_steps", ">= 0", self.warmup_steps)
        require(self.smax >= 1, "smax", ">= 1", self.smax)
        require(0 <= self.ema < 1, "ema", "in [0, 1)", self.ema)

    def describe(self) -> str:
        return f"drift-optimal period={self.period}"


@dataclass(frozen=True, kw_only=True)
class StaggeredConfig:
    """The default schedule: every layer saved periodically, the layers' phases spread over the
    steps so each step hands over a slice of the model, periods drift-aware (``1/sqrt(drift
    rate)``) under a byte budget (see :mod:`layercheck.policies.staggered`). Never writes more than full
    checkpoints at the same unsaved drift where layers drift alike; fewer where they differ."""

    selective: ClassVar[bool] = True

    period: int | None = 100
    """Mean save period in steps, what "a full checkpoint every N steps" means: the byte budget is
    the changing layers' bytes / ``period`` per step; a layer at the mean drift rate is saved every
    ``period`` steps. ``None``: set by ``max_bytes_per_step`` alone."""
    max_bytes_per_step: int | None = None
    """Cap on the bytes handed over per step on average (12 bytes per parameter: fp32 weight and two
    Adam moments); periods stretch to fit it. ``None``: no cap beyond ``period``."""
    warmup_steps: int = 0
    """First saves start at this step, staggered over the first period (no whole-model burst);
    until a layer has one, recovery takes it from the run's initial state (step 0: rebuilt by
    ``layercheck train``, written once at ``attach`` by an own loop)."""
    smax: int = 1000
    """Staleness backstop: a layer that changed and has gone this many steps unsaved is persisted
    whatever the schedule says (layers that did not change since their last save are exact)."""
    drift_aware: bool = True
    """Periods ~ 1/sqrt(layer drift rate) under the same budget (minimises unsaved drift);
    ``false``: equal periods for every changing layer (minimises weighted staleness)."""
    min_gain: float = 0.1
    """Drift-aware periods are used only while they are predicted to lose at least this fraction
    less unsaved drift than equal periods at the same bytes; below it (layers drifting nearly
    alike) the schedule keeps equal periods, whose bytes are exactly full checkpoints', because
    the rate estimate's noise and re-phasing would cost more than the gain. In [0, 1)."""
    ema: float = 0.98
    """Per-step smoothing of each layer's drift-rate estimate (exponential moving average)."""
    replan_tolerance: float = 1.25
    """Periods are re-planned every mean period; a layer's period changes only when the new one
    differs by more than this factor, so phases and per-step bytes stay steady."""
    spread_phases: bool = False
    """Where a period has more steps than there are layers, place the layers' first saves evenly
    over the first period, as far apart as the time storage takes to write them allows, instead of
    on consecutive steps. Storage that writes just the schedule's bytes per step then has at most
    about the largest layer waiting to be written, where consecutive saves leave most of a
    checkpoint waiting once a period (``layercheck simulate``'s ``peak backlog``: 0.2 against 0.7 of
    a checkpoint on a 135M-parameter model at ``period=100``): less host memory in flight, and no
    wait at ``persistence.max_inflight_bytes``. The same bytes. The price: the last layer's first
    save comes up to a period after ``warmup_steps`` (or after a recovery, for a layer with no
    version yet), so a failure before it recovers that layer from the run's initial state; after a
    warm-up the first period's unsaved drift weighs more (+5 to +15% mean unsaved drift over 800
    steps of that model with a warm-up of 50 to 200; without one, the same); and the layers'
    versions differ more in age at a failure."""
    drift_every: int = 10
    """Steps between drift measurements: step 1, then every ``drift_every``-th (1, 11, 21, ... for
    10). The schedule needs each layer's drift *rate*, not every step's drift, so the ranks measure
    it only on these steps (exactly: that step's update alone) and the probe costs that much less
    per step; in between, a layer's unsaved drift is estimated from its rate. 1: every step."""

    def __post_init__(self) -> None:
        require_finite(self)
        require(self.period is None or self.period >= 1, "period", "None or >= 1", self.period)
        require(
            self.max_bytes_per_step is None or self.max_bytes_per_step >= 1,
            "max_bytes_per_step",
            "None or >= 1",
            self.max_bytes_per_step,
        )
        require(
            self.period is not None or self.max_bytes_per_step is not None,
            "period",
            "set when max_bytes_per_step is None (one of them sets the budget)",
            self.period,
        )
        require(self.warmup_steps >= 0, "warmup_steps", ">= 0", self.warmup_steps)
        require(self.smax >= 1, "smax", ">= 1", self.smax)
        require(0 <= self.ema < 1, "ema", "in [0, 1)", self.ema)
        require(self.replan_tolerance >= 1, "replan_tolerance", ">= 1", self.replan_tolerance)
        require(0 <= self.min_gain < 1, "min_gain", "in [0, 1)", self.min_gain)
        require(self.drift_every >= 1, "drift_every", ">= 1 (1: every step)", self.drift_every)

    def describe(self) -> str:
        budget = [f"period={self.period}"] if self.period is not None else []
        budget += [f"max={self.max_bytes_per_step}B/step"] if self.max_bytes_per_step else []
        budget += ["spread"] if self.spread_phases else []
        return " ".join(["staggered", *budget])


@dataclass(frozen=True, kw_only=True)
class IntervalConfig:
    """Fixed-interval full checkpoints, what DeepSpeed and Ray users do today."""

    selective: ClassVar[bool] = False
    drift_every: ClassVar[int] = 1

    interval: int = 100
    """Persist every layer at every step that is a multiple of this."""

    def __post_init__(self) -> None:
        require(self.interval >= 1, "interval", ">= 1", self.interval)

    def describe(self) -> str:
        return "interval"


@dataclass(frozen=True, kw_only=True)
class NeverConfig:
    """No checkpoints at all: the lower bound on overhead, the upper bound on lost work."""

    selective: ClassVar[bool] = False
    drift_every: ClassVar[int] = 1

    def describe(self) -> str:
        return "never"


POLICY_CONFIGS: dict[str, type] = {
    "staggered": StaggeredConfig,
    "layercheck": LayerCheckConfig,
    "drift-optimal": DriftOptimalConfig,
    "interval": IntervalConfig,
    "never": NeverConfig,
}
PolicyConfig = StaggeredConfig | LayerCheckConfig | DriftOptimalConfig | IntervalConfig | NeverConfig
#: The policy every way in uses unless told otherwise (the CLI's run config, the API's
#: ``CheckpointConfig``): on the benchmark it never writes more than full checkpoints at the
#: same freshness, where the paper's thresholds write 1.4-2.8x (docs/schedules.md, "What it measured").
DEFAULT_POLICY = "staggered"


def policy_config(name: str, params: Mapping[str, Any] | None = None, *, field: str = "policy") -> PolicyConfig:
    """The config of the policy called ``name`` from its parameters."""
    require(name in POLICY_CONFIGS, f"{field}.name", f"one of {sorted(POLICY_CONFIGS)}", name)
    return from_mapping(POLICY_CONFIGS[name], params or {}, field=field)


def drift_measured(step: int, every: int) -> bool:
    """Whether the ranks measure drift at optimizer step ``step`` (1, 2, ...) when a policy asks
    for it every ``every`` steps (its config's ``drift_every``): step 1, then every ``every``-th
    (1, 1 + every, 1 + 2 every, ...), the same steps on every rank and in every attempt."""
    return every <= 1 or (step - 1) % every == 0


def schedule_warnings(policy: PolicyConfig, steps: int, *, prefix: str = "policy.") -> list[str]:
    """What a schedule too long for a run of ``steps`` steps means, for the run's start: layers
    the policy never saves before the end come back from the initial state (step 0) at a failure,
    as stale as the failure is late. ``prefix`` names the fields as the user set them."""

    def warn(field: str, value: int, what: str, fix: int) -> str:
        return (
            f"{prefix}{field} = {value} >= steps = {steps}: {what} before the run ends (only its final "
            f"save); a failure recovers such layers from the initial state, as stale as the failure is "
            f"late; set {prefix}{field} below {steps} (e.g. {fix}) to protect them"
        )

    warnings = []
    warmup = policy.warmup_steps if isinstance(policy, (StaggeredConfig, LayerCheckConfig, DriftOptimalConfig)) else 0
    if policy.selective and warmup >= steps:
        warnings.append(warn("warmup_steps", warmup, "the policy saves no layer", max(1, steps // 10)))
    period = policy.period if isinstance(policy, StaggeredConfig) else None
    if period is not None and period >= steps:
        warnings.append(warn("period", period, "most layers are not saved", max(1, steps // 4)))
    if isinstance(policy, IntervalConfig) and policy.interval >= steps:
        warnings.append(warn("interval", policy.interval, "no layer is saved", max(1, steps // 4)))
    return warnings


def policy_name(config: PolicyConfig) -> str:
    """The name a policy config is registered under (``layercheck``, ``interval``, ``never``)."""
    for name, cls in POLICY_CONFIGS.items():
        if isinstance(config, cls):
            return name
    raise TypeError(f"not a policy config: {config!r}")
