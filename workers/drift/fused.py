"""DriftAdamW's fused step: update each tensor and count ``sum |theta_t - theta_{t-1}|`` in one pass.

The ``foreach`` step (:meth:`layercheck.workers.drift.adamw.DriftAdamW._diff_step`) copies every owned
element before torch's AdamW step and diffs it after. Here the count rides along with the update:

* on CUDA, with Triton importable and every tensor contiguous fp32, one kernel launch per
  optimizer step (every param group and step count a slot) reads ``param, grad, exp_avg,
  exp_avg_sq`` once, writes them once, and adds ``|new - old|`` of the owned elements into the
  slot's float64 accumulator on the device (:mod:`layercheck.workers.drift.triton_step`, imported only then);
* everywhere else (CPU; CUDA without Triton, where it is slower than the ``foreach`` step),
  torch ops over cache-sized chunks of each tensor, in the order torch's
  single-tensor AdamW uses, so the parameters and moments are bit-equal to
  ``torch.optim.AdamW(foreach=False)`` and the count is exactly what snapshot-and-diff sees
  (summation order aside).

The count is of ``new - old`` as stored, not of the update as computed: the two differ by the
rounding of the addition, and snapshot-and-diff (the reference) sees the former.
"""

from __future__ import annotations

import functools
import logging
import operator
from collections.abc import Sequence

import torch

from layercheck.workers.drift.fused_work import (
    AdamWScalars,
    FusedGroup,
    FusedPlan,
    LayerStep,
    Windows,
    counted_runs,
    only_grads_moved,
    to_device,
)

logger = logging.getLogger(__name__)

#: Elements per chunk of the torch path on CPU: the four state chunks and two temporaries (6 MiB)
#: stay in the last-level cache; smaller chunks pay more in per-op overhead than they win
#: (bench model cpu-small, 2 cores: 2^15 18 ms, 2^18 10 ms, 2^20 9.9 ms, whole tensors 10.3 ms).
#: On CUDA (no Triton) each tensor is one chunk: every op there is a kernel launch.
TORCH_CHUNK = 1 << 18


def triton_eligible(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether the Triton kernel can take these tensors (CUDA, :func:`kernel_takes`) and Triton
    imports. Never imports Triton for CPU tensors."""
    if not tensors or not tensors[0].is_cuda:
        return False
    return kernel_takes(tensors) and _triton_available()


def kernel_takes(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether the kernel's layout takes these tensors: one device, each contiguous fp32 (which
    kind of device is :func:`triton_eligible`'s question). Each test is a ``map`` over the tensors
    (0.39 ms for the 0.5B shape's 1160 on a 2-core CPU; one generator of the same tests took 0.88 ms)."""
    if len(set(map(torch.Tensor.get_device, tensors))) != 1:  # one device (a CPU tensor is -1)
        return False
    return set(map(_dtype, tensors)) == {torch.float32} and all(map(torch.Tensor.is_contiguous, tensors))


_dtype = operator.attrgetter("dtype")


@functools.cache
def _warn_torch_path_on_cuda() -> None:
    logger.warning(
        "drift_step='fused' on CUDA without its Triton kernel (Triton not importable, or tensors not "
        "contiguous fp32): running torch ops per tensor, slower than drift_step='foreach'"
    )


def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@torch.no_grad()
def adamw_l1_groups(groups: Sequence[FusedGroup]) -> list[torch.Tensor]:
    """One AdamW update of every group's params, in place; returns each group's
    ``sum |new - old|`` over its counted elements as a float64 scalar on the params' device.
    On CUDA with Triton, one kernel launch for all of them."""
    if not groups:
        return []
    device = groups[0].params[0].device
    if triton_eligible([t for g in groups for t in g.tensors()]):
        from layercheck.workers.drift.triton_step import adamw_l1_triton_groups

        return list(adamw_l1_triton_groups(groups).unbind())
    if device.type == "cuda":
        _warn_torch_path_on_cuda()
    return [_torch_l1(group) for group in groups]


def _torch_l1(group: FusedGroup) -> torch.Tensor:
    """The torch path for one group at one step count: its count, a float64 scalar."""
    total = torch.zeros((), dtype=torch.float64, device=group.params[0].device)
    for p, g, m, v, w in zip(group.params, group.grads, group.exp_avgs, group.exp_avg_sqs, group.windows):
        total += adamw_l1_torch(p, g, m, v, w, group.scalars)
    return total


def adamw_l1_plan(plan: FusedPlan, grads: Sequence[torch.Tensor], scalars: Sequence[AdamWScalars]) -> torch.Tensor:
    """:func:`adamw_l1_groups` over a kept :class:`FusedPlan` with this step's gradients and each
    slot's scalars: each slot's count, a float64 vector on the device. On CUDA one kernel launch,
    its address table rebuilt only when an address changed."""
    tensors = plan.tensor_lists(grads)
    if plan.triton is not False:
        addrs = [list(map(torch.Tensor.data_ptr, ts)) for ts in tensors]  # params, grads, exp_avgs, exp_avg_sqs
        known = plan.tables.get("addrs")
        if addrs != known:
            if plan.triton and only_grads_moved(known, addrs):  # only they are checked, the work table kept
                plan.triton = triton_eligible([plan.params[0], *grads])
            else:  # the first launch, or storage moved under a tensor: all checked again, every table anew
                plan.tables.clear()
                plan.triton = triton_eligible([t for ts in tensors for t in ts])
        if plan.triton:
            from layercheck.workers.drift.triton_step import adamw_l1_triton_plan

            return adamw_l1_triton_plan(plan, addrs, scalars)
    if plan.params[0].is_cuda:
        _warn_torch_path_on_cuda()
    slots = zip(plan.starts, plan.starts[1:])
    return torch.stack(
        [
            _torch_l1(
                FusedGroup(
                    params=plan.params[a:b],
                    grads=grads[a:b],
                    exp_avgs=plan.exp_avgs[a:b],
                    exp_avg_sqs=plan.exp_avg_sqs[a:b],
                    windows=plan.windows[a:b],
                    scalars=s,
                )
            )
            for (a, b), s in zip(slots, scalars)
        ]
    )


def adamw_l1_layers(step: LayerStep) -> torch.Tensor:
    """One AdamW update of every tensor of ``step`` in place, each window's ``sum |new - old|``
    added to its accumulator (a layer's, where a flat partition holds several): the
    accumulators, a float64 vector on the device. On CUDA with Triton one kernel launch;
    elsewhere the torch path."""
    device = step.params[0].device
    if triton_eligible(step.tensors()):
        from layercheck.workers.drift.triton_step import adamw_l1_triton_layers

        return adamw_l1_triton_layers(step)
    if device.type == "cuda":
        _warn_torch_path_on_cuda()
    acc = torch.zeros(step.count, dtype=torch.float64, device=device)
    counts: list[torch.Tensor] = []
    into: list[int] = []
    tensors = zip(step.params, step.grads, step.exp_avgs, step.exp_avg_sqs, step.windows, step.accumulators, step.slots)
    for p, g, m, v, runs, accs, slot in tensors:
        counts += adamw_l1_torch_slots(p, g, m, v, [(run,) for run in runs], step.scalars[slot])
        into += accs
    if counts:
        acc.index_add_(0, to_device(torch.tensor(into), device), torch.stack(counts))
    return acc


def adamw_l1(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    windows: Sequence[Windows | None],
    scalars: AdamWScalars,
) -> torch.Tensor:
    """:func:`adamw_l1_groups` for one group: its count."""
    (l1,) = adamw_l1_groups(
        [
            FusedGroup(
                params=params, grads=grads, exp_avgs=exp_avgs, exp_avg_sqs=exp_avg_sqs, windows=windows, scalars=scalars
            )
        ]
    )
    return l1


def adamw_l1_torch(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    windows: Windows | None,
    scalars: AdamWScalars,
    chunk: int | None = None,
) -> torch.Tensor:
    """The torch path for one tensor: its update chunk by chunk, as torch's single-tensor AdamW
    orders the ops; the count as a float64 scalar. A non-contiguous tensor is one chunk."""
    runs = counted_runs(param.numel(), windows)
    (total,) = adamw_l1_torch_slots(param, grad, exp_avg, exp_avg_sq, [runs], scalars, chunk)
    return total


def adamw_l1_torch_slots(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    slots: Sequence[Windows],
    scalars: AdamWScalars,
    chunk: int | None = None,
) -> list[torch.Tensor]:
    """:func:`adamw_l1_torch` counting into several accumulators: ``slots[k]`` holds the runs
    of the tensor that count towards the ``k``-th (a flat partition's layers); each a float64 scalar."""
    chunk = chunk or (max(param.numel(), 1) if param.is_cuda else TORCH_CHUNK)
    tensors: tuple[torch.Tensor, ...] = (param, grad, exp_avg, exp_avg_sq)
    if not all(t.is_contiguous() for t in tensors):
        chunk = max(param.numel(), 1)
        flats = tensors
    else:
        flats = tuple(t.view(-1) for t in tensors)
    numel = param.numel()
    slot_runs = [[(s, s + n) for s, n in runs if n > 0] for runs in slots]
    totals = [torch.zeros((), dtype=torch.float64, device=param.device) for _ in slots]
    for start in range(0, numel, chunk):
        length = min(chunk, numel - start)
        p, g, m, v = (t.narrow(0, start, length) if t.dim() == 1 else t for t in flats)
        old = p.clone()
        _adamw_update(p, g, m, v, scalars)
        delta = old.sub_(p).abs_().view(-1)
        for total, runs in zip(totals, slot_runs):
            for lo, hi in runs:
                lo, hi = max(lo, start), min(hi, start + length)
                if lo < hi:
                    total += delta[lo - start : hi - start].sum()
    return totals


def _adamw_update(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, s: AdamWScalars) -> None:
    """torch's ``_single_tensor_adam`` with decoupled weight decay, op for op."""
    if s.weight_decay != 0:
        p.mul_(s.decay)
    m.lerp_(g, 1 - s.beta1)
    v.mul_(s.beta2).addcmul_(g, g, value=1 - s.beta2)
    denom = (v.sqrt() / s.bias_correction2_sqrt).add_(s.eps)
    p.addcdiv_(m, denom, value=-s.step_size)
