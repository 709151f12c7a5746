"""The drift probe: per layer, how far the last optimizer step moved this rank's shard.

:class:`layercheck.workers.drift_adamw.DriftAdamW` accumulates ``sum |update|`` per param group while it
steps; param groups are layer-aligned, so summing a layer's groups gives the layer's
``sum |theta_t - theta_{t-1}|`` on this rank. The probe restricts the optimizer's count to
the elements this rank owns (see :mod:`layercheck.workers.layout`), pairs each sum with that element
count, and reads every layer with one device-to-host transfer per step.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

import torch

from layercheck.workers.drift_adamw import DriftAdamW
from layercheck.workers.layout import StateLayout

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LayerDrift:
    """This rank's share of each layer's drift after one step: L1 of the update and element count."""

    step: int
    l1: Mapping[str, float]
    numel: Mapping[str, int]

    def drift(self) -> dict[str, float]:
        """``l1 / numel`` per layer, over this rank's shard only (0 where it owns nothing)."""
        return {k: (self.l1[k] / n if n else 0.0) for k, n in self.numel.items()}


class DriftReader(Protocol):
    """What the loop and a restore ask of a rank's drift probe: :class:`DriftProbe`, or one
    wrapped (the benchmark times its reads)."""

    @property
    def numel(self) -> Mapping[str, int]: ...

    def collect(self, step: int) -> LayerDrift: ...

    def reset(self) -> None: ...


class DriftProbe:
    """Reads the per-layer update L1 that :class:`DriftAdamW` gathered since the last read."""

    def __init__(self, layout: StateLayout) -> None:
        self._optimizer: DriftAdamW = layout.optimizer
        self._layers = tuple(layout.layers)
        self._numel = {name: layer.owned_numel for name, layer in layout.layers.items()}
        self._layer_of_group = {g["name"]: name for name, layer in layout.layers.items() for g in layer.groups}
        for layer in layout.layers.values():
            for master in layer.masters:
                windows = [(p.start, p.slice.length) for p in layer.owned if p.master is master]
                self._optimizer.set_drift_windows(master, windows)

    @property
    def numel(self) -> Mapping[str, int]:
        return dict(self._numel)

    def reset(self) -> None:
        """Drop drift gathered so far (after a restore wrote new weights)."""
        self._optimizer.take_drift()

    def collect(self, step: int) -> LayerDrift:
        """This rank's drift for the step(s) since the last call; one host sync."""
        by_group = self._optimizer.take_drift()
        index = {name: i for i, name in enumerate(self._layers)}
        sums = torch.zeros(len(self._layers), dtype=torch.float64)
        if by_group:
            names = list(by_group)
            values = torch.stack([by_group[n].detach().double() for n in names]).cpu()
            for name, value in zip(names, values.tolist()):
                sums[index[self._layer_of_group[name]]] += value
        return LayerDrift(step=step, l1=dict(zip(self._layers, sums.tolist())), numel=dict(self._numel))


def global_drift(local: LayerDrift, group: torch.distributed.ProcessGroup | None = None) -> dict[str, float]:
    """Each layer's drift over all ranks: ``sum(l1) / sum(numel)`` (one all-reduce; collective)."""
    names = list(local.numel)
    both = torch.tensor([[local.l1[n] for n in names], [float(local.numel[n]) for n in names]], dtype=torch.float64)
    if torch.distributed.get_backend(group) == "nccl":
        both = both.cuda()
    torch.distributed.all_reduce(both, group=group)
    both = both.cpu()
    return {n: (l1 / count if count else 0.0) for n, l1, count in zip(names, both[0].tolist(), both[1].tolist())}
