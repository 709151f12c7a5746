"""AdamW that measures, on the steps it is asked to, how far it moved each parameter group.

The drift probe needs ``sum |theta_t - theta_{t-1}|`` per layer on the steps it measures (every
step for the paper's threshold policy, every ``drift_every``-th for the default schedule). Every
step is ``torch.optim.AdamW``'s own (:func:`torch.optim.adamw.adamw`: its fused kernel on CPU and
CUDA, with the step counts on the parameters' device as torch keeps them for it), so the trajectory
is torch's whichever steps are measured. On a measured step (``measuring``) each group's owned
elements are copied before the update and the L1 of the difference is taken after (one
``_foreach_norm``), into a per-group accumulator kept on the device: exact, with the copy of one
group alive at a time. No host synchronisation happens here; :class:`layercheck.workers.drift.probe.DriftProbe`
reads all groups at once, one sync per measured step.

DeepSpeed hands this optimizer flat fp32 partitions (ZeRO 1-3), fp32 copies (ZeRO-0 bf16) or
the model's own parameters (ZeRO-0 fp32), and may step it with a temporarily trimmed
``param_groups`` list (ZeRO 1/2) or once per sub-group (ZeRO-3). Accumulators are therefore
keyed by each group's unique ``name``, never by list position.

``drift_step="fused"`` counts the drift inside the update instead, with no copy and no second
pass (a Triton kernel on CUDA, cache-sized chunks elsewhere; :mod:`layercheck.workers.drift.fused`);
its parameters and moments are those of ``torch.optim.AdamW(foreach=False)`` op for op, so its
measured steps round differently from the others. ``drift_step="auto"`` (the default) picks the
measured step by the committed benchmark figures (:mod:`layercheck.workers.drift.choice`): today
``foreach``, on CPU and on CUDA.

Under FSDP2 the parameters and moments are DTensors: every step, measured or not, runs on their
local shards (:mod:`layercheck.workers.drift.local`), the same ops torch's AdamW would dispatch
through DTensor to them, without the dispatch.

One file over 400 lines, and one idea: the optimizer whose every step is torch's and whose
measured steps also count the drift; the fused variant's own work lives in ``fused.py`` and
``triton_step.py``, the choice between them in ``choice.py``.
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Callable, Iterable, Sequence
from contextlib import nullcontext
from itertools import accumulate
from typing import Any, cast

import torch
from torch.optim.adamw import adamw as adamw_functional
from torch.optim.optimizer import ParamsT

from layercheck.workers.config import DRIFT_STEPS
from layercheck.workers.drift.choice import StepChoice, choose_steps
from layercheck.workers.drift.clock import OwnStep, ProbeClock
from layercheck.workers.drift.fused import adamw_l1_groups, adamw_l1_plan, triton_eligible
from layercheck.workers.drift.fused_work import AdamWScalars, FusedGroup, FusedPlan, Windows
from layercheck.workers.drift.local import LocalTensors, has_dtensors, local_tensors
from layercheck.workers.layout import local_part

logger = logging.getLogger(__name__)


def _grads(params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """The gradients of ``params``, every one set (:meth:`DriftAdamW.step` steps no other)."""
    return cast("list[torch.Tensor]", [p.grad for p in params])


#: Fused-step plans kept (each holds its launcher's tables: ~2 MB on the device for the 0.5B shape).
MAX_PLANS = 64

_EXP_AVG = operator.itemgetter("exp_avg")
_EXP_AVG_SQ = operator.itemgetter("exp_avg_sq")


def _by_count(
    counts: list[float], params: list[torch.Tensor], states: list[dict[str, Any]]
) -> list[tuple[float, list[torch.Tensor], list[dict[str, Any]]]]:
    """A group's params (and their states) split by step count, one part per count: normally
    one part, the whole group."""
    if counts.count(counts[0]) == len(counts):
        return [(counts[0], params, states)]
    parts: dict[float, tuple[list[torch.Tensor], list[dict[str, Any]]]] = {}
    for count, p, state in zip(counts, params, states):
        members, member_states = parts.setdefault(count, ([], []))
        members.append(p)
        member_states.append(state)
    return [(count, members, member_states) for count, (members, member_states) in parts.items()]


class DriftAdamW(torch.optim.AdamW):
    """Decoupled-weight-decay Adam (Loshchilov & Hutter) with a per-group L1 of every update.

    Same hyper-parameters, state keys (``step``, ``exp_avg``, ``exp_avg_sq``) and state-dict
    format as :class:`torch.optim.AdamW` without ``amsgrad``/``maximize``; each group must
    carry a unique ``name`` (one is made up when missing).
    """

    def __init__(
        self,
        params: ParamsT,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        drift_step: str = "auto",
    ) -> None:
        self._choice: tuple[str, StepChoice] | None = None  # (device type, choice), made at first use
        self._drift_step = "auto"
        self.drift_step = drift_step
        self.measuring = True
        """Whether the next steps count the L1 of what they move. The probe turns it off on the
        steps it does not measure: those cost what ``torch.optim.AdamW``'s step costs."""
        self._drift_l1: dict[str, torch.Tensor] = {}
        self.probe_clock = ProbeClock()
        """The time of the measured steps' drift work: the copies and norms beside the foreach
        update; the fused step's whole update, the drift being counted inside it."""
        self.own_step = OwnStep()
        """torch's AdamW step, timed on the step after each fused one (the probe settles it): what
        a fused step is read against."""
        self._windows: dict[int, tuple[torch.Tensor, Windows]] = {}  # by id(): tensors compare elementwise
        # the fused step's step counts, one tensor per set of groups stepped together (_count_steps)
        self._step_banks: dict[tuple[Any, ...], tuple[torch.Tensor, tuple[torch.Tensor, ...]]] = {}
        self._plans: dict[tuple[Any, ...], FusedPlan] = {}  # the fused step's, per set of groups
        self._dtensors = False  # whether a group holds DTensors (FSDP2): then every step takes their local shards
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, foreach=False)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        param_group.setdefault("name", f"group.{len(self.param_groups)}")
        if any(g["name"] == param_group["name"] for g in self.param_groups):
            raise ValueError(f"duplicate param group name {param_group['name']!r}")
        super().add_param_group(param_group)
        self._dtensors = self._dtensors or has_dtensors(self.param_groups[-1]["params"])
        self._choice = None  # decided again over the new set of parameters
        self._plans.clear()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._plans.clear()  # they hold the tensors being replaced
        super().load_state_dict(state_dict)
        self._choice = None  # the loaded step counts go where the choice keeps them, at the next use

    @property
    def drift_step(self) -> str:
        """How a measured step runs (:data:`~layercheck.workers.config.DRIFT_STEPS`); set it to
        change that (the steps are chosen again, the step counts moved where they then live)."""
        return self._drift_step

    @drift_step.setter
    def drift_step(self, value: str) -> None:
        if value not in DRIFT_STEPS:
            raise ValueError(f"drift_step: must be one of {DRIFT_STEPS}, got {value!r}")
        self._drift_step = value
        self._choice = None

    def set_drift_windows(self, tensor: torch.Tensor, windows: Sequence[tuple[int, int]]) -> None:
        """Count only these element runs of ``tensor`` towards drift (default: all of it).

        Used to skip ZeRO padding and, under ZeRO-0 where every rank updates whole parameters,
        to make each rank report only its own slice so that sums over ranks are not doubled.
        """
        numel = local_part(tensor).numel()  # (a DTensor's windows are runs of its local shard)
        for start, length in windows:
            if start < 0 or length < 0 or start + length > numel:
                raise ValueError(f"drift window ({start}, {length}) outside a tensor of {numel} elements")
        self._windows[id(tensor)] = (tensor, tuple((int(s), int(n)) for s, n in windows if n > 0))
        self._plans.clear()

    def init_state(self, p: torch.Tensor) -> dict[str, Any]:
        """The state of ``p``, created (step 0, zero moments) if it has none yet."""
        state = self.state[p]
        if len(state) == 0:
            on_device = self._steps_on([p]).counts_on_device  # as torch keeps them for its fused kernel
            state["step"] = torch.tensor(0.0, dtype=torch.float32, device=p.device if on_device else "cpu")
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
        if self.measuring and self._fused(stepped):
            self._fused_step(stepped)
            return loss
        own = self.own_step.span(stepped[0][1][0].device) if stepped and not self.measuring else None
        with own or nullcontext():
            for group, params in stepped:
                if self.measuring:
                    self._diff_step(group, params)
                else:
                    self._torch_step(group, params)
        return loss

    @property
    def measured_step(self) -> str | None:
        """How a measured step runs: ``fused`` or ``foreach`` (``None``: no parameters yet)."""
        steps = self.steps
        if steps is None and self._choice is not None:  # ZeRO-3 hands its groups their params only to step them
            steps = self._choice[1]
        return steps.measured if steps is not None else None

    @property
    def steps(self) -> StepChoice | None:
        """The steps this optimizer runs on its parameters' kind of device
        (:func:`~layercheck.workers.drift.choice.choose_steps`); ``None``: no parameters yet.
        Decided at first use (after DeepSpeed moved the parameters) and again when they move."""
        params = [p for group in self.param_groups for p in group["params"]]
        return self._steps_on(params) if params else None

    def _fused(self, stepped: list[tuple[dict[str, Any], list[torch.Tensor]]]) -> bool:
        """Whether a measured step is the fused one (:attr:`steps`)."""
        params = [p for _, group_params in stepped for p in group_params[:1]]
        return bool(params) and self._steps_on(params).measured == "fused"

    def _steps_on(self, params: list[torch.Tensor]) -> StepChoice:
        """The choice for ``params``' kind of device, made once per kind: logged with its reason,
        and the step counts that exist moved to where it keeps them."""
        device_type = params[0].device.type
        if self._choice is not None and self._choice[0] == device_type:
            return self._choice[1]
        everything = [p for group in self.param_groups for p in group["params"]] or params
        choice = choose_steps(self.drift_step, device_type, triton=lambda: triton_eligible(local_tensors(everything)))
        self._choice = (device_type, choice)
        self._place_counts(everything, choice)
        logger.info(
            "DriftAdamW on %s: measured steps %s, torch's %s AdamW on the others (%s)",
            device_type,
            choice.measured,
            choice.torch_step,
            choice.reason,
        )
        return choice

    def _place_counts(self, params: list[torch.Tensor], choice: StepChoice) -> None:
        """Move each step count of ``params`` to where ``choice`` keeps them (a loaded state dict's,
        or those of a choice before): on the parameter's device, or on the host."""
        for p in params:
            state = self.state.get(p) or {}
            step = state.get("step")
            device = p.device if choice.counts_on_device else torch.device("cpu")
            if isinstance(step, torch.Tensor) and step.device != device:
                state["step"] = step.to(device)

    def _torch_step(self, group: dict[str, Any], params: list[torch.Tensor]) -> None:
        """``torch.optim.AdamW``'s step of one group: its fused kernel (CPU, CUDA; the step counts
        on the parameters' device) or its foreach one, as :attr:`steps` says."""
        beta1, beta2 = group["betas"]
        fused = self._steps_on(params).torch_step == "fused"
        states = [self.init_state(p) for p in params]
        local_params, grads, exp_avgs, exp_avg_sqs = self._tensors(params, states)
        adamw_functional(
            local_params,
            grads,
            exp_avgs,
            exp_avg_sqs,
            [],
            [s["step"] for s in states],
            foreach=not fused,
            fused=fused,
            amsgrad=False,
            beta1=beta1,
            beta2=beta2,
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=False,
        )

    def _tensors(self, params: list[torch.Tensor], states: list[dict[str, Any]]) -> tuple[list[torch.Tensor], ...]:
        """``params``, their gradients, exp_avgs and exp_avg_sqs as a step computes on them: a
        DTensor's local shard (read at each step: FSDP2 may swap it), any other tensor itself."""
        tensors = (params, _grads(params), list(map(_EXP_AVG, states)), list(map(_EXP_AVG_SQ, states)))
        return tuple(map(local_tensors, tensors)) if self._dtensors else tensors

    def _diff_step(self, group: dict[str, Any], params: list[torch.Tensor]) -> None:
        """:meth:`_torch_step`, and the L1 of what it moved over the elements this rank owns."""
        views = self._owned_views(params)
        with self.probe_clock.span(params[0].device):
            before = [v.clone() for v in views]
        self._torch_step(group, params)
        if views:  # no owned element: no entry
            with self.probe_clock.span(params[0].device):
                diffs = torch._foreach_sub(views, before)
                self._add_l1(group["name"], torch.stack(torch._foreach_norm(diffs, 1)).sum())

    def _fused_step(self, stepped: list[tuple[dict[str, Any], list[torch.Tensor]]]) -> None:
        """Every group's update in one :func:`adamw_l1_plan` call (one kernel launch on CUDA).

        On a GPU the step is bound by issuing it, not by the update, so the per-tensor work is
        kept from step to step in a :class:`FusedPlan` per set of groups; a step checks that its
        tensors are the plan's and reads only what changes (gradients, counts, hyper-parameters)."""
        params = [p for _, group_params in stepped for p in group_params]
        if not params:  # no gradient anywhere: nothing to step
            return
        # by groups and first tensor: a group's ZeRO-3 sub-groups (each its own flat tensor) each keep one
        key = (*(g["name"] for g, _ in stepped), id(params[0]))
        plan = self._plans.get(key)
        if plan is None or not self._plan_holds(plan, params):
            plan = self._plans[key] = self._build_plan(stepped, params)
            while len(self._plans) > MAX_PLANS:  # sets of groups that come and go: the oldest goes
                del self._plans[next(iter(self._plans))]
        counts = self._count_steps(key, plan.states)
        slot_counts = plan.slot_counts(counts)
        if slot_counts is None:  # a group's tensors at different counts: they step apart
            self._fused_step_by_count(stepped, plan.states, counts)
            return
        scalars = [AdamWScalars.of_group(group, count) for (group, _), count in zip(stepped, slot_counts)]
        grads = _grads(params) if plan.sources is None else local_tensors(_grads(params))
        with self.probe_clock.span(params[0].device):
            l1 = adamw_l1_plan(plan, grads, scalars)
        self.own_step.replaced()
        for name, owned, value in zip(plan.names, plan.owned, l1.unbind()):
            if owned:  # as the foreach step: no owned element, no entry (the kernel counts it anyway)
                self._add_l1(name, value)

    def _build_plan(
        self, stepped: list[tuple[dict[str, Any], list[torch.Tensor]]], params: list[torch.Tensor]
    ) -> FusedPlan:
        states = [self.init_state(p) for p in params]
        windows = [self._windows_of(p) for p in params]
        starts = tuple(accumulate((len(group_params) for _, group_params in stepped), initial=0))
        exp_avgs, exp_avg_sqs = list(map(_EXP_AVG, states)), list(map(_EXP_AVG_SQ, states))
        sources = (params, exp_avgs, exp_avg_sqs) if self._dtensors else None
        if sources is not None:  # the plan steps their local shards
            params, exp_avgs, exp_avg_sqs = map(local_tensors, sources)
        return FusedPlan(
            names=tuple(g["name"] for g, _ in stepped),
            starts=starts,
            params=params,
            states=states,
            exp_avgs=exp_avgs,
            exp_avg_sqs=exp_avg_sqs,
            windows=windows,
            owned=tuple(any(w is None or w for w in windows[a:b]) for a, b in zip(starts, starts[1:])),
            state_table=self.state,
            state_entries=(list(self.state), list(self.state.values())),
            sources=sources,
            local_params=LocalTensors(sources[0]) if sources is not None else None,
        )

    def _plan_holds(self, plan: FusedPlan, params: list[torch.Tensor]) -> bool:
        """Whether ``plan`` still has this step's tensors: the same parameters, state dicts and
        moments, by identity (a loaded state dict or a new tensor anywhere builds a new plan),
        and the same local shards of DTensor parameters (FSDP2 may swap one).

        The state dicts are looked up only when the state mapping's entries are no longer those
        the plan last saw: a lookup hashes each parameter in Python (55 µs for the 0.5B shape's
        290 on a 2-core CPU, against 18 µs to compare the entries)."""
        state = self.state
        own_params, own_exp_avgs, own_exp_avg_sqs = plan.keys()
        if (
            plan.state_table is not state
            or len(params) != len(own_params)
            or not all(map(operator.is_, params, own_params))
            or (plan.local_params is not None and plan.local_params.swapped())
        ):
            return False
        keys, values = plan.state_entries
        same = len(state) == len(keys) and all(map(operator.is_, state, keys))
        if not (same and all(map(operator.is_, state.values(), values))):  # an entry added, dropped or replaced
            if not all(map(operator.is_, map(state.__getitem__, params), plan.states)):
                return False
            plan.state_entries = (list(state), list(state.values()))
        return all(map(operator.is_, map(_EXP_AVG, plan.states), own_exp_avgs)) and all(
            map(operator.is_, map(_EXP_AVG_SQ, plan.states), own_exp_avg_sqs)
        )

    def _fused_step_by_count(
        self,
        stepped: list[tuple[dict[str, Any], list[torch.Tensor]]],
        states: list[dict[str, Any]],
        counts: list[float],
    ) -> None:
        """:meth:`_fused_step` where a group's tensors are at different step counts (parameters
        stepped apart, as ZeRO-3's sub-groups may leave them): each part of a group at one count
        is a group of its own in one :func:`adamw_l1_groups` call."""
        work: list[tuple[str, FusedGroup]] = []
        offset = 0
        for group, params in stepped:
            group_states = states[offset : offset + len(params)]
            group_counts = counts[offset : offset + len(params)]
            offset += len(params)
            for count, members, member_states in _by_count(group_counts, params, group_states):
                local_members, grads, exp_avgs, exp_avg_sqs = self._tensors(members, member_states)
                work.append(
                    (
                        group["name"],
                        FusedGroup(
                            params=local_members,
                            grads=grads,
                            exp_avgs=exp_avgs,
                            exp_avg_sqs=exp_avg_sqs,
                            windows=[self._windows_of(p) for p in members],
                            scalars=AdamWScalars.of_group(group, count),
                        ),
                    )
                )
        with self.probe_clock.span(states[0]["exp_avg"].device):
            l1s = adamw_l1_groups([f for _, f in work])
        self.own_step.replaced()
        for (name, fused), l1 in zip(work, l1s):
            if any(w is None or w for w in fused.windows):
                self._add_l1(name, l1)

    def _count_steps(self, key: tuple[Any, ...], states: list[dict[str, Any]]) -> list[float]:
        """Add one to the step count of each of ``states`` and return the new counts.

        torch keeps one 0-d step tensor per parameter; adding one to 290 of them on the host
        (``_foreach_add_``) and reading them back cost ~0.9 ms a step, most of the fused step's
        host time. So the first fused step over a set of groups (``key``) gathers their counts
        into one tensor, a *bank*, and puts a view of it in each state: later steps add one to
        the bank and read it in one call each. Whoever replaces a state's step tensor (a loaded
        state dict) is noticed by identity and the bank is gathered again; whoever writes into
        one (``fill_``) writes into the bank."""
        steps = [s["step"] for s in states]
        bank, views = self._step_banks.get(key, (None, ()))
        if bank is None or len(views) != len(steps) or not all(map(operator.is_, steps, views)):
            if len({(t.device, t.dtype) for t in steps}) != 1 or any(t.dim() != 0 for t in steps):
                torch._foreach_add_(steps, 1)  # mixed steps: the per-tensor way
                return torch.stack([t.float().cpu() for t in steps]).tolist()
            bank = torch.stack(steps)
            views = tuple(bank.unbind())
            for state, view in zip(states, views):
                state["step"] = view
            self._step_banks[key] = (bank, views)
        bank.add_(1)
        return bank.tolist()

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
            local = local_part(p).detach()  # (a DTensor's windows are runs of its local shard)
            if windows is None:
                views.append(local)
            elif not local.is_contiguous():
                raise ValueError(f"drift windows on a non-contiguous tensor of shape {tuple(local.shape)}")
            else:
                flat = local.view(-1)
                views.extend(flat.narrow(0, s, n) for s, n in windows)
        return views
