"""DriftAdamW's fused step: update each tensor and count ``sum |theta_t - theta_{t-1}|`` in one pass.

The ``foreach`` step (:meth:`layercheck.workers.drift_adamw.DriftAdamW._step_group`) materialises every
parameter's update and reads it again for its L1. Here the count rides along with the update:

* on CUDA, with Triton importable and every tensor contiguous fp32, one kernel launch per
  optimizer step (every param group and step count a slot) reads ``param, grad, exp_avg,
  exp_avg_sq`` once, writes them once, and adds ``|new - old|`` of the owned elements into the
  slot's float64 accumulator on the device (:mod:`layercheck.workers.drift_triton`, imported only then);
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
from collections.abc import Sequence
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

#: (start, length) runs of a tensor's flattened elements that count towards drift.
Windows = tuple[tuple[int, int], ...]

#: Elements per chunk of the torch path on CPU: the four state chunks and two temporaries (6 MiB)
#: stay in the last-level cache; smaller chunks pay more in per-op overhead than they win
#: (bench model cpu-small, 2 cores: 2^15 18 ms, 2^18 10 ms, 2^20 9.9 ms, whole tensors 10.3 ms).
#: On CUDA (no Triton) each tensor is one chunk: every op there is a kernel launch.
TORCH_CHUNK = 1 << 18

#: Elements one Triton program updates (a row of the work table; it loops over them in blocks).
TRITON_CHUNK = 1 << 14


@dataclass(frozen=True, kw_only=True)
class AdamWScalars:
    """The per-step scalars of one AdamW update at step count ``step`` (1 for the first step)."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    step: float

    @property
    def decay(self) -> float:
        """What decoupled weight decay multiplies the parameter by."""
        return 1 - self.lr * self.weight_decay

    @property
    def step_size(self) -> float:
        return self.lr / (1 - self.beta1**self.step)

    @property
    def bias_correction2_sqrt(self) -> float:
        return (1 - self.beta2**self.step) ** 0.5


def counted_runs(numel: int, windows: Windows | None) -> Windows:
    """The runs of a tensor that count: ``windows``, or all of it when it has none."""
    return ((0, numel),) if windows is None else windows


def work_rows(
    numels: Sequence[int], windows: Sequence[Windows | None], chunk: int
) -> list[tuple[int, int, int, int, int]]:
    """The Triton kernel's work table: rows ``(tensor, start, stop, count_lo, count_hi)``.

    Each row updates elements ``[start, stop)`` of one tensor (at most ``chunk`` of them) and
    counts those in ``[count_lo, count_hi)``. The rows of a tensor partition it, so every element
    is updated exactly once; a chunk that meets several counted runs is split at their edges so
    that each row meets at most one.
    """
    if chunk <= 0:
        raise ValueError(f"chunk must be positive, got {chunk}")
    rows: list[tuple[int, int, int, int, int]] = []
    for index, (numel, runs) in enumerate(zip(numels, windows)):
        runs = sorted((s, s + n) for s, n in counted_runs(numel, runs) if n > 0)
        for start in range(0, numel, chunk):
            stop = min(start + chunk, numel)
            inside = [(max(lo, start), min(hi, stop)) for lo, hi in runs if lo < stop and hi > start]
            if len(inside) <= 1:
                lo, hi = inside[0] if inside else (start, start)
                rows.append((index, start, stop, lo, hi))
                continue
            edges = [start] + [lo for lo, _ in inside[1:]] + [stop]
            for (a, b), (lo, hi) in zip(zip(edges, edges[1:]), inside):
                rows.append((index, a, b, lo, hi))
    return rows


def triton_eligible(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether the Triton kernel can take these tensors (CUDA, contiguous fp32, one device) and
    Triton imports. Never imports Triton for CPU tensors."""
    first = tensors[0]
    if not first.is_cuda or any(
        not t.is_cuda or t.dtype != torch.float32 or not t.is_contiguous() or t.device != first.device for t in tensors
    ):
        return False
    return _triton_available()


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


@dataclass(frozen=True, kw_only=True)
class FusedGroup:
    """Tensors stepped together at one step count with one set of scalars (a param group, or
    the part of one at a given step count), and each tensor's counted windows."""

    params: Sequence[torch.Tensor]
    grads: Sequence[torch.Tensor]
    exp_avgs: Sequence[torch.Tensor]
    exp_avg_sqs: Sequence[torch.Tensor]
    windows: Sequence[Windows | None]
    scalars: AdamWScalars

    def tensors(self) -> list[torch.Tensor]:
        return [*self.params, *self.grads, *self.exp_avgs, *self.exp_avg_sqs]


@torch.no_grad()
def adamw_l1_groups(groups: Sequence[FusedGroup]) -> list[torch.Tensor]:
    """One AdamW update of every group's params, in place; returns each group's
    ``sum |new - old|`` over its counted elements as a float64 scalar on the params' device.
    On CUDA with Triton, one kernel launch for all of them."""
    if not groups:
        return []
    device = groups[0].params[0].device
    if all(g.params[0].device == device for g in groups) and triton_eligible([t for g in groups for t in g.tensors()]):
        from layercheck.workers.drift_triton import adamw_l1_triton_groups

        return list(adamw_l1_triton_groups(groups).unbind())
    if device.type == "cuda":
        _warn_torch_path_on_cuda()
    out = []
    for group in groups:
        total = torch.zeros((), dtype=torch.float64, device=group.params[0].device)
        for p, g, m, v, w in zip(group.params, group.grads, group.exp_avgs, group.exp_avg_sqs, group.windows):
            total += adamw_l1_torch(p, g, m, v, w, group.scalars)
        out.append(total)
    return out


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
    chunk = chunk or (max(param.numel(), 1) if param.is_cuda else TORCH_CHUNK)
    tensors = (param, grad, exp_avg, exp_avg_sq)
    if not all(t.is_contiguous() for t in tensors):
        chunk = max(param.numel(), 1)
        flats = tensors
    else:
        flats = tuple(t.view(-1) for t in tensors)
    numel = param.numel()
    runs = [(s, s + n) for s, n in counted_runs(numel, windows) if n > 0]
    total = torch.zeros((), dtype=torch.float64, device=param.device)
    for start in range(0, numel, chunk):
        length = min(chunk, numel - start)
        p, g, m, v = (t.narrow(0, start, length) if t.dim() == 1 else t for t in flats)
        old = p.clone()
        _adamw_update(p, g, m, v, scalars)
        delta = old.sub_(p).abs_().view(-1)
        for lo, hi in runs:
            lo, hi = max(lo, start), min(hi, start + length)
            if lo < hi:
                total += delta[lo - start : hi - start].sum()
    return total


def _adamw_update(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, s: AdamWScalars) -> None:
    """torch's ``_single_tensor_adam`` with decoupled weight decay, op for op."""
    if s.weight_decay != 0:
        p.mul_(s.decay)
    m.lerp_(g, 1 - s.beta1)
    v.mul_(s.beta2).addcmul_(g, g, value=1 - s.beta2)
    denom = (v.sqrt() / s.bias_correction2_sqrt).add_(s.eps)
    p.addcdiv_(m, denom, value=-s.step_size)
