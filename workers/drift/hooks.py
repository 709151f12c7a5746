"""The drift probe for a user's own optimizer (``layercheck.attach``, the Hugging Face callback):
measured around its step, through torch's optimizer step hooks.

:class:`~layercheck.workers.drift.adamw.DriftAdamW` counts drift inside its own update, but a
user's optimizer is theirs: torch's ``AdamW`` with their groups, DeepSpeed's ``FusedAdam`` or
``DeepSpeedCPUAdam`` from their config, stepped by DeepSpeed over flat partitions that span
layers. Every one of them is a ``torch.optim.Optimizer``, whose ``step`` runs the pre- and
post-step hooks registered on it, however it is called (by DeepSpeed's ZeRO wrapper, through
an LR scheduler's wrapper, once per ZeRO-3 sub-group). On a step the probe measures:

* ``copy``: a copy of the elements about to be stepped this rank owns before the step, the L1
  of the difference after (the same work as snapshot-and-diff, but the copy is made for the
  step and let go after it: no fp32 copy of the shard held between steps);
* ``fused``: for torch's ``AdamW`` (or ``Adam`` without weight decay), the AdamW update itself
  with each layer's count inside it (:func:`~layercheck.workers.drift.fused.adamw_l1_layers`: no
  copy, no second pass; one Triton launch on CUDA): the pre-step hook steps every parameter that
  has a gradient and hides the gradients from torch's own step, the post-step hook gives them
  back. On CPU the parameters and moments are bit-equal to the step torch would have taken (its
  single-tensor and foreach steps, the same bits there); on CUDA within float rounding of it.
  A step with a closure (which computes the gradients inside the step), with sparse gradients,
  with other step hooks on the optimizer (a pre-step hook after this one, clipping gradients,
  would come after the update; a post-step one before it would see no gradients), or of an
  optimizer that has changed since into one :func:`fused_refusal` refuses, is measured by ``copy``.

Under FSDP2 the parameters are DTensors: both modes copy, diff and step their local shards
(:mod:`layercheck.workers.drift.local`), read again at every measured step (FSDP2 may swap them).

On a step it does not measure, the hooks return at once: the user's step is untouched. The one
exception, in ``fused`` mode: the step after each measured one is timed (not changed), so that the
summary can set the fused step against the user's own step it replaces.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Mapping
from typing import Any, cast

import torch
from torch.optim import optimizer as optimizer_module

from layercheck.workers import optim_state
from layercheck.workers.drift.clock import OwnStep, ProbeClock, Span
from layercheck.workers.drift.fused import adamw_l1_layers
from layercheck.workers.drift.fused_work import AdamWScalars, LayerStep, Windows, to_device
from layercheck.workers.drift.local import has_dtensors, local_tensors
from layercheck.workers.drift.probe import DriftSchedule, LayerDrift
from layercheck.workers.layout import StateLayout, local_part
from layercheck.workers.progress import ProbeCost

logger = logging.getLogger(__name__)

#: The probe's name when it runs the fused step in place of the user's AdamW.
FUSED_IN_PLACE = "fused (in place of your AdamW)"

#: The hooks a probe holds on an optimizer: a second probe attached to it takes their place.
_HOOKED: weakref.WeakKeyDictionary[torch.optim.Optimizer, tuple[Any, Any]] = weakref.WeakKeyDictionary()


def fused_refusal(optimizer: torch.optim.Optimizer, *, exact: bool = True) -> str | None:
    """Why the fused step cannot take ``optimizer``'s place (``None``: it can). ``exact``: only
    where it is bit-equal to the optimizer's own step (CPU); else also on CUDA, where its Triton
    kernel is within float rounding of torch's step, not bit-equal to it."""
    if type(optimizer) not in (torch.optim.AdamW, torch.optim.Adam):
        return f"{type(optimizer).__name__} is not torch's AdamW or Adam"
    for group in optimizer.param_groups:
        for flag in ("amsgrad", "maximize", "capturable", "differentiable", "fused"):
            if group.get(flag):
                return f"{flag}=True"
        if group["weight_decay"] and not group.get("decoupled_weight_decay", isinstance(optimizer, torch.optim.AdamW)):
            return "Adam's L2 weight decay (the fused step is AdamW's decoupled one)"
        tensors = [key for key in ("lr", "eps", "weight_decay") if isinstance(group[key], torch.Tensor)]
        if tensors or any(isinstance(beta, torch.Tensor) for beta in group["betas"]):
            return f"a tensor hyper-parameter ({', '.join(tensors) or 'betas'})"
        for p in group["params"]:
            if p.dtype != torch.float32 or p.is_sparse or not p.is_contiguous():
                return f"a {p.dtype} {tuple(p.shape)} parameter that is not dense, contiguous fp32"
            if exact and p.device.type != "cpu":
                return (
                    f"a parameter on {p.device}: there the fused step is within float rounding of your "
                    "optimizer's, not bit-equal (drift_probe='fused' runs it all the same)"
                )
    return None


class StepHookProbe:
    """Per layer, ``sum |theta_t - theta_{t-1}|`` over this rank's owned elements, measured
    around the user's optimizer step (``fused``: inside an AdamW step taking its place)."""

    def __init__(self, layout: StateLayout, *, every: int = 1, fused: bool = False, exact: bool = True) -> None:
        optimizer = layout.optimizer
        if fused and (reason := fused_refusal(optimizer, exact=exact)) is not None:
            raise ValueError(
                f"drift_probe='fused' cannot step this optimizer in its place: {reason}; "
                "drift_probe='step_hooks' or 'snapshot_diff' measures it as it steps"
            )
        self.schedule = DriftSchedule(every)
        self.fused = fused
        self._exact = exact
        self._optimizer = optimizer
        self._layers = tuple(layout.layers)
        self._numel = {name: layer.owned_numel for name, layer in layout.layers.items()}
        # per master tensor (by id: tensors compare elementwise), its owned runs and the layer each
        # counts into; a layer's pieces that follow each other in a master make one run
        runs: dict[int, tuple[list[tuple[int, int]], list[int]]] = {}
        for index, layer in enumerate(layout.layers.values()):
            for piece in layer.owned:
                windows, layers = runs.setdefault(id(piece.master), ([], []))
                if layers and layers[-1] == index and windows[-1][0] + windows[-1][1] == piece.start:
                    windows[-1] = (windows[-1][0], windows[-1][1] + piece.slice.length)
                else:
                    windows.append((piece.start, piece.slice.length))
                    layers.append(index)
        self._runs: dict[int, tuple[Windows, tuple[int, ...]]] = {
            key: (tuple(windows), tuple(layers)) for key, (windows, layers) in runs.items()
        }
        masters = [p for layer in layout.layers.values() for p in layer.masters]
        self._device = masters[0].device if masters else torch.device("cpu")
        self._dtensors = has_dtensors(masters)  # FSDP2: the fused step takes their local shards
        self._sums = torch.zeros(len(self._layers), dtype=torch.float64, device=self._device)
        self._copies: list[tuple[torch.Tensor, torch.Tensor, int]] = []  # (owned run, its copy, layer)
        self._hidden: list[tuple[torch.Tensor, torch.Tensor]] = []  # (param, its gradient) hidden from torch's step
        self._clock = ProbeClock()
        self._own = OwnStep()  # the user's own step, on the step after each fused one
        self._own_span: Span | None = None
        previous = _HOOKED.pop(optimizer, ())
        for handle in previous:
            handle.remove()
        _HOOKED[optimizer] = (
            optimizer.register_step_pre_hook(self._before_step),
            optimizer.register_step_post_hook(self._after_step),
        )
        logger.info("drift probe around %s's step (%s)", type(optimizer).__name__, "fused" if fused else "copy")

    @property
    def numel(self) -> Mapping[str, int]:
        return dict(self._numel)

    @property
    def name(self) -> str:
        return FUSED_IN_PLACE if self.fused else "step_hooks"

    def _stepped(self, closure: bool) -> list[torch.Tensor]:
        """The parameters the step about to run updates: those with a gradient (any, when a
        closure will compute them inside the step), in the groups it sees (DeepSpeed may trim
        ``param_groups`` for a call, or step ZeRO-3's sub-groups in turn)."""
        groups = self._optimizer.param_groups
        return [p for group in groups for p in group["params"] if closure or p.grad is not None]

    @torch.no_grad()
    def _before_step(self, optimizer: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self._give_back()  # (a step that raised after this hook never ran the post-step one)
        self._copies.clear()
        self._own_span = None  # (likewise: that step's time is not counted)
        if not self.schedule.armed:
            self._own_span = self._own.span(self._device)
            if self._own_span is not None:
                self._own_span.start()
            return
        if not self._layers:
            return
        # torch hands the hook the step's arguments, the optimizer first
        closure = (args[1] if len(args) > 1 else kwargs.get("closure")) is not None
        stepped = self._stepped(closure)
        if not stepped:
            return
        with self._clock.span(self._device):
            if self.fused and not closure and self._may_replace(stepped):
                self._fused_step(stepped)
                return
            for p in stepped:
                runs, layers = self._runs.get(id(p), ((), ()))
                flat = local_part(p).detach().view(-1)  # (a DTensor's: its runs are of the local shard)
                for (start, length), layer in zip(runs, layers):
                    run = flat.narrow(0, start, length)
                    self._copies.append((run, run.clone(), layer))

    def _may_replace(self, stepped: list[torch.Tensor]) -> bool:
        """Whether the fused step may take this step's place: checked on each measured step, since
        the optimizer may have gained groups or moved tensors, or gained other step hooks, which
        would run after the update (a pre-step hook clipping gradients) or see no gradients."""
        others = (
            len(self._optimizer._optimizer_step_pre_hooks) + len(self._optimizer._optimizer_step_post_hooks) > 2
            or bool(optimizer_module._global_optimizer_pre_hooks)
            or bool(optimizer_module._global_optimizer_post_hooks)
        )
        sparse = any(p.grad is not None and p.grad.is_sparse for p in stepped)
        return not others and not sparse and fused_refusal(self._optimizer, exact=self._exact) is None

    def _give_back(self) -> None:
        for p, grad in self._hidden:
            p.grad = grad
        self._hidden.clear()

    @torch.no_grad()
    def _after_step(self, optimizer: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self._give_back()
        if self._own_span is not None:
            self._own_span.stop()
            self._own_span = None
        if not self._copies:
            return
        with self._clock.span(self._device):
            runs, copies, layers = zip(*self._copies)
            self._copies.clear()
            norms = torch._foreach_norm(torch._foreach_sub(runs, copies), 1, dtype=torch.float64)
            self._sums.index_add_(0, to_device(torch.tensor(layers), self._device), torch.stack(norms))

    def _fused_step(self, stepped: list[torch.Tensor]) -> None:
        """torch's AdamW step over ``stepped`` (one kernel launch on CUDA), each layer's drift
        counted; their gradients then hidden from torch's own step (given back by
        :meth:`_after_step`, or here if it fails)."""
        optimizer = self._optimizer
        group_of = {id(p): group for group in optimizer.param_groups for p in group["params"]}
        slot_of: dict[tuple[int, float], int] = {}  # (group, step count) -> its scalars' slot
        scalars: list[AdamWScalars] = []
        states, slots = [], []
        for p in stepped:
            state = optim_state.init_state(optimizer, p)  # as torch's AdamW starts a parameter's state
            state["step"] += 1
            group, count = group_of[id(p)], state["step"].item()
            slot = slot_of.setdefault((id(group), count), len(scalars))
            if slot == len(scalars):
                scalars.append(AdamWScalars.of_group(group, count))
            states.append(state)
            slots.append(slot)
        grads = cast("list[torch.Tensor]", [p.grad for p in stepped])  # (stepped: those that have one)
        self._hidden += zip(stepped, grads)
        for p in stepped:
            p.grad = None
        try:
            runs = [self._runs.get(id(p), ((), ())) for p in stepped]
            moments = [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states]
            if self._dtensors:  # their local shards, read at each step: FSDP2 may have swapped one since
                params, grads, exp_avgs, exp_avg_sqs = (local_tensors(ts) for ts in (stepped, grads, *moments))
            else:
                params, (exp_avgs, exp_avg_sqs) = [p.detach() for p in stepped], moments
            step = LayerStep(
                params=params,
                grads=grads,
                exp_avgs=exp_avgs,
                exp_avg_sqs=exp_avg_sqs,
                windows=[windows for windows, _ in runs],
                accumulators=[layers for _, layers in runs],
                slots=slots,
                scalars=scalars,
                count=len(self._layers),
            )
            sums = adamw_l1_layers(step)
        except BaseException:
            self._give_back()
            raise
        self._sums += sums
        self._own.replaced()

    def collect(self, step: int) -> LayerDrift:
        """This rank's drift at step ``step`` (one host sync); on a step the schedule does not
        measure, nothing and no sync."""
        measured = self.schedule.measured(step)
        self.schedule.arm_after(step)
        replaced, own_s, own_steps = self._own.settle(measured=measured, next_measured=self.schedule.armed)
        cost = ProbeCost(self.name, self._clock.take(), measured, replaced, own_s, own_steps)
        if not measured:
            return LayerDrift(step=step, l1={}, numel=dict(self._numel), measured=False, cost=cost)
        values = self._sums.tolist()
        self._sums.zero_()
        return LayerDrift(step=step, l1=dict(zip(self._layers, values)), numel=dict(self._numel), cost=cost)

    def reset(self, next_step: int | None = None) -> None:
        """Drop what was counted so far (a restore wrote new weights, or a seek to ``next_step - 1``)
        and arm for the next step (:meth:`DriftSchedule.reset`)."""
        self._sums.zero_()
        self._own.reset()
        self.schedule.reset(next_step)

    def measure_every(self, every: int) -> None:
        """Measure from now on every ``every``-th step (the policy's ``drift_every``), and the next."""
        self.schedule = DriftSchedule(every)
        self.reset()
