"""AdamW that measures, on the steps it is asked to, how far it moved each parameter group.

The drift probe needs ``sum |theta_t - theta_{t-1}|`` per layer on the steps it measures (every
step for the paper's threshold policy, every ``drift_every``-th for the default schedule). Every
step is ``torch.optim.AdamW``'s own (:func:`torch.optim.adamw.adamw`: fused on CPU, foreach on
CUDA, where this optimizer keeps its step counts on the host), so the trajectory is torch's
whichever steps are measured. On a measured step (``measuring``) each group's owned elements are
copied before the update and the L1 of the difference is taken after (one ``_foreach_norm``),
into a per-group accumulator kept on the device: exact, with the copy of one group alive at a
time. No host synchronisation happens here; :class:`layercheck.workers.drift.DriftProbe` reads all
groups at once, one sync per measured step.

DeepSpeed hands this optimizer flat fp32 partitions (ZeRO 1-3), fp32 copies (ZeRO-0 bf16) or
the model's own parameters (ZeRO-0 fp32), and may step it with a temporarily trimmed
``param_groups`` list (ZeRO 1/2) or once per sub-group (ZeRO-3). Accumulators are therefore
keyed by each group's unique ``name``, never by list position.

``drift_step="fused"`` counts the drift inside the update instead, with no copy and no second
pass (a Triton kernel on CUDA, cache-sized chunks elsewhere; :mod:`layercheck.workers.drift_fused`);
its parameters and moments are those of ``torch.optim.AdamW(foreach=False)`` op for op, so its
measured steps round differently from the others.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Any, cast

import torch
from torch.optim.adamw import adamw as adamw_functional

from layercheck.workers.config import DRIFT_STEPS
from layercheck.workers.drift_fused import adamw_l1_groups
from layercheck.workers.drift_fused_work import AdamWScalars, FusedGroup, Windows

logger = logging.getLogger(__name__)


def _grads(params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """The gradients of ``params``, every one set (:meth:`DriftAdamW.step` steps no other)."""
    return cast("list[torch.Tensor]", [p.grad for p in params])


class DriftAdamW(torch.optim.AdamW):
    """Decoupled-weight-decay Adam (Loshchilov & Hutter) with a per-group L1 of every update.

    Same hyper-parameters, state keys (``step``, ``exp_avg``, ``exp_avg_sq``) and state-dict
    format as :class:`torch.optim.AdamW` without ``amsgrad``/``maximize``; each group must
    carry a unique ``name`` (one is made up when missing).
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        drift_step: str = "foreach",
    ) -> None:
        if drift_step not in DRIFT_STEPS:
            raise ValueError(f"drift_step: must be one of {DRIFT_STEPS}, got {drift_step!r}")
        self.drift_step = drift_step
        self.measuring = True
        """Whether the next steps count the L1 of what they move. The probe turns it off on the
        steps it does not measure: those cost what ``torch.optim.AdamW``'s step costs."""
        self._drift_l1: dict[str, torch.Tensor] = {}
        self._windows: dict[int, tuple[torch.Tensor, Windows]] = {}  # by id(): tensors compare elementwise
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, foreach=False)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        param_group.setdefault("name", f"group.{len(self.param_groups)}")
        if any(g["name"] == param_group["name"] for g in self.param_groups):
            raise ValueError(f"duplicate param group name {param_group['name']!r}")
        super().add_param_group(param_group)

    def set_drift_windows(self, tensor: torch.Tensor, windows: Sequence[tuple[int, int]]) -> None:
        """Count only these element runs of ``tensor`` towards drift (default: all of it).

        Used to skip ZeRO padding and, under ZeRO-0 where every rank updates whole parameters,
        to make each rank report only its own slice so that sums over ranks are not doubled.
        """
        numel = tensor.numel()
        for start, length in windows:
            if start < 0 or length < 0 or start + length > numel:
                raise ValueError(f"drift window ({start}, {length}) outside a tensor of {numel} elements")
        self._windows[id(tensor)] = (tensor, tuple((int(s), int(n)) for s, n in windows if n > 0))

    def init_state(self, p: torch.Tensor) -> dict[str, Any]:
        """The state of ``p``, created (step 0, zero moments) if it has none yet."""
        state = self.state[p]
        if len(state) == 0:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state

    def take_drift(self) -> dict[str, torch.Tensor]:
        """The L1 of all updates applied since the last call, per group name (device scalars)."""
        drift, self._drift_l1 = self._drift_l1, {}
        return drift

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        stepped = [(g, [p for p in g["params"] if p.grad is not None]) for g in self.param_groups]
        stepped = [(g, params) for g, params in stepped if params]
        if self.measuring and self.drift_step == "fused":
            self._fused_step(stepped)
            return loss
        for group, params in stepped:
            if self.measuring:
                self._diff_step(group, params)
            else:
                self._torch_step(group, params)
        return loss

    def _torch_step(self, group: dict[str, Any], params: list[torch.Tensor]) -> None:
        """``torch.optim.AdamW``'s step of one group: its fused kernel where the step counts live
        on the parameters' device (CPU), else its foreach one."""
        beta1, beta2 = group["betas"]
        states = [self.init_state(p) for p in params]
        adamw_functional(
            params,
            _grads(params),
            [s["exp_avg"] for s in states],
            [s["exp_avg_sq"] for s in states],
            [],
            [s["step"] for s in states],
            foreach=params[0].device.type != "cpu",
            fused=params[0].device.type == "cpu",
            amsgrad=False,
            beta1=beta1,
            beta2=beta2,
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=False,
        )

    def _diff_step(self, group: dict[str, Any], params: list[torch.Tensor]) -> None:
        """:meth:`_torch_step`, and the L1 of what it moved over the elements this rank owns."""
        views = self._owned_views(params)
        before = [v.clone() for v in views]
        self._torch_step(group, params)
        if views:  # no owned element: no entry
            self._add_l1(group["name"], torch.stack(torch._foreach_norm(torch._foreach_sub(views, before), 1)).sum())

    def _fused_step(self, stepped: list[tuple[dict[str, Any], list[torch.Tensor]]]) -> None:
        """Every group's update in one :func:`adamw_l1_groups` call (one kernel launch on CUDA):
        per-tensor work is kept to what the launch needs, since on a GPU the step is otherwise
        bound by issuing it, not by the update."""
        states = [[self.init_state(p) for p in params] for _, params in stepped]
        steps = [s["step"] for group_states in states for s in group_states]
        if not steps:
            return
        torch._foreach_add_(steps, 1)
        counts = iter(torch.stack(steps).tolist())
        work: list[tuple[str, FusedGroup]] = []
        for (group, params), group_states in zip(stepped, states):
            by_count: dict[float, list[int]] = {}
            for i in range(len(params)):
                by_count.setdefault(float(next(counts)), []).append(i)
            beta1, beta2 = group["betas"]
            for count, members in by_count.items():  # one slot per step count (normally one)
                work.append(
                    (
                        group["name"],
                        FusedGroup(
                            params=[params[i] for i in members],
                            grads=_grads(params[i] for i in members),
                            exp_avgs=[group_states[i]["exp_avg"] for i in members],
                            exp_avg_sqs=[group_states[i]["exp_avg_sq"] for i in members],
                            windows=[self._windows_of(params[i]) for i in members],
                            scalars=AdamWScalars(
                                lr=group["lr"],
                                beta1=beta1,
                                beta2=beta2,
                                eps=group["eps"],
                                weight_decay=group["weight_decay"],
                                step=count,
                            ),
                        ),
                    )
                )
        for (name, fused), l1 in zip(work, adamw_l1_groups([f for _, f in work])):
            # as the foreach step: no owned element, no entry (the kernel counts the L1 anyway)
            if self.measuring and any(w is None or w for w in fused.windows):
                self._add_l1(name, l1)

    def _windows_of(self, tensor: torch.Tensor) -> Windows | None:
        entry = self._windows.get(id(tensor))
        return entry[1] if entry is not None and entry[0] is tensor else None

    def _add_l1(self, name: str, l1: torch.Tensor) -> None:
        previous = self._drift_l1.get(name)
        self._drift_l1[name] = l1 if previous is None else previous + l1

    def _owned_views(self, params: list[torch.Tensor]) -> list[torch.Tensor]:
        """Views of the elements of ``params`` this rank owns (its drift windows; all by default)."""
        views: list[torch.Tensor] = []
        for p in params:
            windows = self._windows_of(p)
            if windows is None:
                views.append(p.detach())
            elif not p.is_contiguous():
                raise ValueError(f"drift windows on a non-contiguous tensor of shape {tuple(p.shape)}")
            else:
                flat = p.detach().view(-1)
                views.extend(flat.narrow(0, s, n) for s, n in windows)
        return views
