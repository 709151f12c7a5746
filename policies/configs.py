"""Typed, validated configuration: the policy configs and a strict mapping → dataclass loader.

Every config is a frozen ``kw_only`` dataclass validated in ``__post_init__``; a bad value
raises :class:`ConfigError` naming the field and what is allowed. :func:`from_mapping` builds
one from parsed TOML/YAML/JSON, rejecting unknown keys (a typo must not silently fall back to
a default).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, TypeVar, Union

T = TypeVar("T")

ThresholdSchedule = Literal["lr", "constant"]
THRESHOLD_SCHEDULES: tuple[str, ...] = typing.get_args(ThresholdSchedule)


class ConfigError(ValueError):
    """A configuration value is missing, unknown or out of range; the message names the field."""


def require(condition: bool, field: str, allowed: str, value: object) -> None:
    if not condition:
        raise ConfigError(f"{field}: must be {allowed}, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class LayerCheckConfig:
    """The paper's adaptive policy (DESIGN.md, "The policy, exactly")."""

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


@dataclass(frozen=True, kw_only=True)
class DriftOptimalConfig:
    """Per-layer save periods proportional to 1/sqrt(drift rate): for a given write rate, the
    schedule that minimises the parameter-weighted drift a failure loses (see
    :class:`policies.checkpoint_policy.DriftOptimalPolicy`)."""

    period: int = 50
    """Save period of a layer drifting at the parameter-weighted mean rate."""
    warmup_steps: int = 200
    """No selective persistence before this step; the full base checkpoint is written at it."""
    smax: int = 1000
    """Staleness budget, as for LayerCheck."""
    ema: float = 0.9
    """Smoothing of each layer's per-step drift rate (exponential moving average)."""

    def __post_init__(self) -> None:
        require(self.period >= 1, "period", ">= 1", self.period)
        require(self.warmup_steps >= 0, "warmup_steps", ">= 0", self.warmup_steps)
        require(self.smax >= 1, "smax", ">= 1", self.smax)
        require(0 <= self.ema < 1, "ema", "in [0, 1)", self.ema)


@dataclass(frozen=True, kw_only=True)
class IntervalConfig:
    """Fixed-interval full checkpoints, what DeepSpeed and Ray users do today."""

    interval: int = 100
    """Persist every layer at every step that is a multiple of this."""

    def __post_init__(self) -> None:
        require(self.interval >= 1, "interval", ">= 1", self.interval)


@dataclass(frozen=True, kw_only=True)
class NeverConfig:
    """No checkpoints at all: the lower bound on overhead, the upper bound on lost work."""


POLICY_CONFIGS: dict[str, type] = {
    "layercheck": LayerCheckConfig,
    "drift-optimal": DriftOptimalConfig,
    "interval": IntervalConfig,
    "never": NeverConfig,
}
PolicyConfig = Union[LayerCheckConfig, DriftOptimalConfig, IntervalConfig, NeverConfig]


def policy_config(name: str, params: Mapping[str, Any] | None = None, *, field: str = "policy") -> PolicyConfig:
    """The config of the policy called ``name`` from its parameters."""
    require(name in POLICY_CONFIGS, f"{field}.name", f"one of {sorted(POLICY_CONFIGS)}", name)
    return from_mapping(POLICY_CONFIGS[name], params or {}, field=field)


def policy_name(config: PolicyConfig) -> str:
    """The name a policy config is registered under (``layercheck``, ``interval``, ``never``)."""
    for name, cls in POLICY_CONFIGS.items():
        if isinstance(config, cls):
            return name
    raise TypeError(f"not a policy config: {config!r}")


def from_mapping(cls: type[T], data: Mapping[str, Any], *, field: str = "") -> T:
    """Build the dataclass ``cls`` from ``data``: nested dataclasses recursively, unknown keys
    refused, simple types checked; errors name the dotted field."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"{field or cls.__name__}: must be a table/mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}  # type: ignore[arg-type]
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ConfigError(f"{field or cls.__name__}: unknown key(s) {unknown}; allowed: {sorted(fields)}")
    kwargs = {name: _convert(hints[name], value, _join(field, name)) for name, value in data.items()}
    try:
        return cls(**kwargs)
    except TypeError as exc:  # a required field is missing
        raise ConfigError(f"{field or cls.__name__}: {exc}") from None
    except ConfigError as exc:
        raise ConfigError(f"{field}.{exc}" if field else str(exc)) from None
    except ValueError as exc:  # a component's own validation
        raise ConfigError(f"{field}: {exc}" if field else str(exc)) from None


def to_mapping(config: Any) -> dict[str, Any]:
    """The plain-data form of a config dataclass (for JSON, logs and Ray)."""
    return dataclasses.asdict(config)


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _convert(hint: Any, value: Any, field: str) -> Any:
    origin = typing.get_origin(hint)
    if origin in (Union, types.UnionType):
        options = typing.get_args(hint)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _convert(option, value, field)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(errors[0] if len(errors) == 1 else f"{field}: {value!r} fits none of {options}")
    if origin is Literal:
        allowed = typing.get_args(hint)
        require(value in allowed, field, f"one of {list(allowed)}", value)
        return value
    if origin in (tuple, list):
        require(isinstance(value, (list, tuple)), field, "a list", value)
        args = typing.get_args(hint)
        item = args[0] if args else Any
        return tuple(_convert(item, v, f"{field}[{i}]") for i, v in enumerate(value))
    if origin in (dict, Mapping) or hint in (dict, Mapping):
        require(isinstance(value, Mapping), field, "a table/mapping", value)
        return dict(value)
    if dataclasses.is_dataclass(hint):
        return from_mapping(hint, value, field=field)
    if hint is bool:
        require(isinstance(value, bool), field, "true or false", value)
        return value
    if hint is int:
        require(isinstance(value, int) and not isinstance(value, bool), field, "an integer", value)
        return value
    if hint is float:
        require(isinstance(value, (int, float)) and not isinstance(value, bool), field, "a number", value)
        return float(value)
    if hint is str:
        require(isinstance(value, str), field, "a string", value)
        return value
    return value
