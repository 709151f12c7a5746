"""The drift probe for any optimizer: keep a copy of each layer's owned fp32 elements and, after
each step, take the L1 of the difference, then refresh the copy.

:class:`layercheck.workers.drift.probe.DriftProbe` reads the drift off :class:`~layercheck.workers.drift.adamw.DriftAdamW`
almost for free, but needs that optimizer and layer-aligned param groups. A user's optimizer
(torch AdamW, DeepSpeed FusedAdam / CPUAdam, any param groups) gives no such hook; comparing the
master weights before and after is exact whatever it does. It costs one extra fp32 copy of this
rank's owned elements in memory and a pass over them per step (see ``bench/drift_probe.py``).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import torch

from layercheck.workers.drift.adamw import DriftAdamW
from layercheck.workers.drift.clock import ProbeClock
from layercheck.workers.drift.hooks import StepHookProbe, fused_refusal
from layercheck.workers.drift.local import LocalTensors
from layercheck.workers.drift.probe import DriftProbe, DriftReader, DriftSchedule, LayerDrift
from layercheck.workers.layout import StateLayout, state_view
from layercheck.workers.progress import ProbeCost

logger = logging.getLogger(__name__)


class SnapshotDiffProbe:
    """Per layer, ``sum |theta_t - theta_{t-1}|`` over this rank's owned elements, by diffing."""

    def __init__(self, layout: StateLayout, *, every: int = 1) -> None:
        self.schedule = DriftSchedule(every)
        self._layers = tuple(layout.layers)
        self._numel = {name: layer.owned_numel for name, layer in layout.layers.items()}
        self._optimizer = layout.optimizer
        self._owned = {name: layer.owned for name, layer in layout.layers.items()}
        # FSDP2's masters are DTensors: the views are of their local shards, taken again when one is swapped
        self._locals = LocalTensors(p.master for pieces in self._owned.values() for p in pieces)
        self._views = self._take_views()
        self._previous = {name: [v.detach().clone() for v in views] for name, views in self._views.items()}
        firsts = [v for views in self._views.values() for v in views[:1]]
        self._device = firsts[0].device if firsts else torch.device("cpu")
        self._clock = ProbeClock()  # the diffs and reference copies of measured steps
        held = sum(t.numel() * t.element_size() for ts in self._previous.values() for t in ts)
        logger.info("snapshot-diff drift probe: %.1f MiB of reference copies", held / 2**20)

    @property
    def numel(self) -> Mapping[str, int]:
        return dict(self._numel)

    def _take_views(self) -> dict[str, list[torch.Tensor]]:
        return {name: [state_view(self._optimizer, p, "fp32") for p in pieces] for name, pieces in self._owned.items()}

    def _current_views(self) -> dict[str, list[torch.Tensor]]:
        """The owned elements' views, taken again if FSDP2 swapped a master's local tensor since
        (:mod:`layercheck.workers.drift.local`; the reference copies hold the values, not the memory)."""
        if self._locals.swapped():
            self._views = self._take_views()
        return self._views

    @torch.no_grad()
    def collect(self, step: int) -> LayerDrift:
        """This rank's drift at step ``step`` against the reference taken after the step before
        (or at :meth:`reset`), one host sync; then the reference for the next measured step. On a
        step the schedule does not measure, and before it, nothing is diffed or copied."""
        measured = self.schedule.measured(step)
        arm = self.schedule.arm_after(step)
        sums: list[torch.Tensor] = []
        if measured or arm:
            with self._clock.span(self._device):
                sums = self._diffs() if measured else []
                if arm:
                    self._copy_reference()
        if not measured:
            return LayerDrift(step=step, l1={}, numel=dict(self._numel), measured=False, cost=self._cost(False))
        values = torch.stack(sums).cpu().tolist() if sums else []
        return LayerDrift(step=step, l1=dict(zip(self._layers, values)), numel=dict(self._numel), cost=self._cost(True))

    def _diffs(self) -> list[torch.Tensor]:
        """Each layer's L1 against its reference, a float64 scalar on the device."""
        sums = []
        current = self._current_views()
        for name in self._layers:
            views, previous = current[name], self._previous[name]
            if not views:
                sums.append(torch.zeros((), dtype=torch.float64, device=self._device))
                continue
            diffs = torch._foreach_sub(views, previous)
            sums.append(torch.stack(torch._foreach_norm(diffs, 1)).sum().double())
        return sums

    def _cost(self, measured: bool) -> ProbeCost:
        return ProbeCost("snapshot_diff", self._clock.take(), measured)

    @torch.no_grad()
    def reset(self, next_step: int | None = None) -> None:
        """Take the current weights as the reference (after a restore wrote new ones, or a seek
        to ``next_step - 1``) and arm for the next step (:meth:`DriftSchedule.reset`)."""
        self._copy_reference()
        self.schedule.reset(next_step)

    def measure_every(self, every: int) -> None:
        """Measure from now on every ``every``-th step (the policy's ``drift_every``), and the next."""
        self.schedule = DriftSchedule(every)
        self.reset()

    def _copy_reference(self) -> None:
        for name, views in self._current_views().items():
            if views:
                torch._foreach_copy_(self._previous[name], views)


#: ``drift_probe`` choices. ``auto``: ``optimizer`` where the engine steps DriftAdamW over
#: layer-aligned groups (the built-in loop); for a user's torch AdamW that the fused step can
#: replace bit for bit (CPU), ``fused`` in its place; else ``snapshot_diff``. ``fused``: DriftAdamW's
#: fused step, or the fused step in place of the user's AdamW (:mod:`layercheck.workers.drift.hooks`;
#: on CUDA its Triton kernel, within float rounding of torch's step). ``step_hooks``: a copy before
#: the user's step and the diff after, no reference copy held.
PROBES: tuple[str, ...] = ("auto", "optimizer", "fused", "step_hooks", "snapshot_diff")


def probe_for(layout: StateLayout, kind: str = "auto", *, every: int = 1) -> DriftReader:
    """The drift probe ``kind`` for ``layout`` (:data:`PROBES`), measuring every ``every``-th step
    (the policy's ``drift_every``). Raises ``ValueError`` for a kind the optimizer cannot take."""
    if kind not in PROBES:
        raise ValueError(f"drift_probe: must be one of {PROBES}, got {kind!r}")
    optimizer = layout.optimizer
    aligned = isinstance(optimizer, DriftAdamW) and all(
        len(layer.groups) == 0 or all(g.get("layer") == name for g in layer.groups)
        for name, layer in layout.layers.items()
    )
    if kind == "optimizer" and not aligned:
        raise ValueError(
            f"drift_probe='optimizer' needs the engine to step DriftAdamW over layer-aligned param "
            f"groups (got {type(optimizer).__name__}); use 'fused', 'step_hooks', 'snapshot_diff' or 'auto'"
        )
    if aligned and kind in ("optimizer", "fused", "auto"):
        if kind == "fused" and isinstance(optimizer, DriftAdamW):  # (aligned: it is one)
            optimizer.drift_step = "fused"
        return DriftProbe(layout, every=every)
    if kind in ("fused", "step_hooks"):
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ValueError(f"drift_probe={kind!r} needs a torch optimizer, got {type(optimizer).__name__}")
        return StepHookProbe(layout, every=every, fused=kind == "fused", exact=False)
    if kind == "auto":
        refusal = fused_refusal(optimizer)
        if refusal is None:
            return StepHookProbe(layout, every=every, fused=True)
        logger.info("drift probe: snapshot-and-diff (the fused step cannot take the optimizer's place: %s)", refusal)
    return SnapshotDiffProbe(layout, every=every)
