"""What a checkpoint policy decides at one step: which layers to persist, and why."""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, TypedDict


class Reason(str, enum.Enum):
    """Why a layer is persisted at a step."""

    BASE = "base"  # the full base checkpoint at the end of warm-up
    DRIFT = "drift"  # accumulated drift reached the threshold
    STALENESS = "staleness"  # unsaved for Smax steps
    INTERVAL = "interval"  # a fixed-interval full checkpoint
    SCHEDULE = "schedule"  # its turn in a staggered periodic schedule


@dataclass(frozen=True)
class PersistDecision:
    """The layers to persist at ``step``, with the reason for each (model order)."""

    step: int
    layers: tuple[tuple[str, Reason], ...] = ()
    memory_period: int | None = None
    """The run's memory-version period in force (``persistence.memory_period``, chosen by the run
    under ``"auto"``): every rank that carries this decision out takes memory versions at that
    period from then on, so all switch at the same step. ``None``: no news (the rank keeps its own)."""

    @classmethod
    def of(cls, step: int, reasons: Mapping[str, Reason] | Iterable[tuple[str, Reason]]) -> PersistDecision:
        items = reasons.items() if isinstance(reasons, Mapping) else reasons
        return cls(step=step, layers=tuple(items))

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.layers)

    @property
    def reasons(self) -> dict[str, Reason]:
        return dict(self.layers)

    @property
    def is_base(self) -> bool:
        return any(reason is Reason.BASE for _, reason in self.layers)

    def __bool__(self) -> bool:
        return bool(self.layers)

    def to_json(self) -> dict[str, object]:
        data: dict[str, object] = {"step": self.step, "layers": {name: reason.value for name, reason in self.layers}}
        if self.memory_period is not None:
            data["memory_period"] = self.memory_period
        return data

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> PersistDecision:  # Any: parsed JSON
        layers = data["layers"]
        assert isinstance(layers, Mapping)
        decision = cls.of(int(data["step"]), {name: Reason(value) for name, value in layers.items()})
        period = data.get("memory_period")
        return decision if period is None else replace(decision, memory_period=int(period))


class PolicyView(TypedDict, total=False):
    """What the run's metrics show of a policy at one learning rate (its ``metrics_view``), each
    key optional: ``smax`` (the staleness budget, in steps), ``accumulated`` and ``threshold`` (per
    layer: drift since the last save, and the drift that triggers the next)."""

    smax: int
    accumulated: dict[str, float]
    threshold: dict[str, float]


@dataclass(frozen=True)
class StepObservation:
    """What a policy sees after optimizer step ``step``: the learning rate that step used and
    each layer's drift (mean absolute update, summed over all ranks' shards)."""

    step: int
    lr: float
    drift: Mapping[str, float] = field(default_factory=dict)
    write_budget_bytes: int | None = None
    """Bytes per step the writers can drain (measured by the runtime), or ``None``: a schedule
    that takes a budget stretches its periods to fit it, so the write queue cannot grow without
    bound."""
    measured: bool = True
    """Whether ``drift`` was measured at this step. A policy that needs only drift rates
    (``drift_every`` > 1) is shown unmeasured steps too, with no drift: missing, not zero."""
