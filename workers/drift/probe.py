"""The drift probe: per layer, how far the last optimizer step moved this rank's shard.

:class:`layercheck.workers.drift.adamw.DriftAdamW` accumulates ``sum |update|`` per param group while it
steps; param groups are layer-aligned, so summing a layer's groups gives the layer's
``sum |theta_t - theta_{t-1}|`` on this rank. The probe restricts the optimizer's count to
the elements this rank owns (see :mod:`layercheck.workers.layout`), pairs each sum with that element
count, and reads every layer with one device-to-host transfer per step.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Protocol

import torch

from layercheck.policies.configs import drift_measured
from layercheck.workers.drift.adamw import DriftAdamW
from layercheck.workers.layout import StateLayout
from layercheck.workers.progress import ProbeCost

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LayerDrift:
    """This rank's share of each layer's drift after one step: L1 of the update and element count.
    ``measured`` false: not measured at this step (the policy's ``drift_every``), ``l1`` empty."""

    step: int
    l1: Mapping[str, float]
    numel: Mapping[str, int]
    measured: bool = True
    cost: ProbeCost | None = None
    """What the probe's own work cost since its previous collect (``None``: not timed)."""


class DriftSchedule:
    """The steps a probe measures (:func:`~layercheck.policies.configs.drift_measured`) and
    whether what it gathered since it was armed is exactly one step's drift.

    A probe *arms* before a step it measures (the optimizer counts that step's update, or the
    snapshot probe takes its reference copy) and is disarmed otherwise, so an unmeasured step
    costs nothing beyond the plain optimizer step. A :meth:`reset` (a restore wrote new weights)
    that knows the next step arms as the schedule says, so a resumed run measures the same steps
    (and steps the optimizer the same way) as a run without the failure; one that does not arms
    for whichever step comes next."""

    ANY = -1

    def __init__(self, every: int = 1) -> None:
        if every < 1:
            raise ValueError(f"drift_every must be >= 1, got {every}")
        self.every = every
        self._armed_for: int | None = self.ANY

    @property
    def armed(self) -> bool:
        return self._armed_for is not None

    def measured(self, step: int) -> bool:
        """Whether what was gathered since arming is exactly step ``step``'s drift (with
        ``every`` 1 always: armed for every step, whatever steps the engine was moved to)."""
        return self.every == 1 or self._armed_for in (step, self.ANY)

    def arm_after(self, step: int) -> bool:
        """After step ``step``: arm for step ``step + 1`` if it is measured. Returns ``armed``."""
        self._armed_for = step + 1 if drift_measured(step + 1, self.every) else None
        return self.armed

    def reset(self, next_step: int | None = None) -> None:
        """Arm for ``next_step`` as the schedule says (``None``: whichever step comes next)."""
        if next_step is None:
            self._armed_for = self.ANY
        else:
            self._armed_for = next_step if drift_measured(next_step, self.every) else None


class DriftReader(Protocol):
    """What the loop and a restore ask of a rank's drift probe: :class:`DriftProbe`, or one
    wrapped (the benchmark times its reads)."""

    @property
    def numel(self) -> Mapping[str, int]: ...

    def collect(self, step: int) -> LayerDrift: ...

    def reset(self, next_step: int | None = None) -> None: ...

    def measure_every(self, every: int) -> None: ...


class DriftProbe:
    """Reads the per-layer update L1 that :class:`DriftAdamW` gathered since the last read."""

    def __init__(self, layout: StateLayout, *, every: int = 1) -> None:
        optimizer = layout.optimizer
        if not isinstance(optimizer, DriftAdamW):
            raise TypeError(f"DriftProbe reads what DriftAdamW gathers; the engine steps a {type(optimizer).__name__}")
        self._optimizer = optimizer
        self.schedule = DriftSchedule(every)
        self._layers = tuple(layout.layers)
        self._numel = {name: layer.owned_numel for name, layer in layout.layers.items()}
        self._numel_view = MappingProxyType(self._numel)  # every step's LayerDrift shares it, read-only
        self._layer_of_group = {g["name"]: name for name, layer in layout.layers.items() for g in layer.groups}
        for layer in layout.layers.values():
            for master in layer.masters:
                windows = [(p.start, p.slice.length) for p in layer.owned if p.master is master]
                self._optimizer.set_drift_windows(master, windows)

    @property
    def numel(self) -> Mapping[str, int]:
        return dict(self._numel)

    def reset(self, next_step: int | None = None) -> None:
        """Drop drift gathered so far (after a restore wrote new weights, or a seek to
        ``next_step - 1``) and arm for the next step (:meth:`DriftSchedule.reset`)."""
        self._optimizer.take_drift()
        self.schedule.reset(next_step)
        self._optimizer.measuring = self.schedule.armed
        self._optimizer.own_step.reset()

    def measure_every(self, every: int) -> None:
        """Measure from now on every ``every``-th step (the policy's ``drift_every``), and the next."""
        self.schedule = DriftSchedule(every)
        self.reset()

    def collect(self, step: int) -> LayerDrift:
        """This rank's drift for step ``step``, one host sync; on a step the schedule does not
        measure, nothing (the optimizer did not count it) and no sync."""
        measured = self.schedule.measured(step)
        self._optimizer.measuring = self.schedule.arm_after(step)
        if not measured:
            self._optimizer.take_drift()  # (empty: the optimizer was not counting)
            return LayerDrift(step=step, l1={}, numel=self._numel_view, measured=False, cost=self._cost(False))
        by_group = self._optimizer.take_drift()
        sums = dict.fromkeys(self._layers, 0.0)
        if by_group:  # one stack and one conversion for all groups: each tensor op costs µs on the host
            values = torch.stack(list(by_group.values())).double().cpu().tolist()
            for name, value in zip(by_group, values):
                sums[self._layer_of_group[name]] += value
        return LayerDrift(step=step, l1=sums, numel=self._numel_view, cost=self._cost(True))

    def _cost(self, measured: bool) -> ProbeCost:
        """What the step's probe work cost; a fused step (the whole update, the drift inside it)
        is read against torch's own step, timed on the next step where that one is not measured."""
        optimizer = self._optimizer
        replaced, own_s, own_steps = optimizer.own_step.settle(measured=measured, next_measured=optimizer.measuring)
        name = f"optimizer ({optimizer.measured_step or 'auto'})"
        return ProbeCost(name, optimizer.probe_clock.take(), measured, replaced, own_s, own_steps)


def global_drift(local: LayerDrift, group: torch.distributed.ProcessGroup | None = None) -> dict[str, float]:
    """Each layer's drift over all ranks: ``sum(l1) / sum(numel)`` (one all-reduce; collective)."""
    names = list(local.numel)
    both = torch.tensor([[local.l1[n] for n in names], [float(local.numel[n]) for n in names]], dtype=torch.float64)
    if torch.distributed.get_backend(group) == "nccl":
        both = both.cuda()
    torch.distributed.all_reduce(both, group=group)
    both = both.cpu()
    return {n: (l1 / count if count else 0.0) for n, l1, count in zip(names, both[0].tolist(), both[1].tolist())}
