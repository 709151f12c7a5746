"""The Triton kernel of DriftAdamW's fused step (CUDA): AdamW and the drift count in one pass.

Imported only by :func:`workers.drift_fused.adamw_l1` once it has seen CUDA tensors and an
importable Triton, so a CPU machine never imports Triton. Under ``TRITON_INTERPRET=1`` the same
kernel runs on CPU tensors (Triton's interpreter), which is how its arithmetic is tested
without a GPU (``tests/test_drift_fused.py``).

One launch covers every tensor of a param group at one step count: a work table (see
:func:`workers.drift_fused.work_rows`) gives each program a chunk of one tensor, and an address
table gives each tensor's ``param, grad, exp_avg, exp_avg_sq`` pointers. Each program reads the
four once, writes three, and adds ``sum |new - old|`` of its counted elements to a float64
accumulator with one atomic add. Both tables are cached: after the first step a group's launch
copies nothing to the device.
"""

# no ``from __future__ import annotations``: Triton reads ``tl.constexpr`` annotations as objects

import functools
import logging
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from workers import drift_fused
from workers.drift_fused import AdamWScalars, Windows, work_rows

logger = logging.getLogger(__name__)

#: Elements per loop iteration of a program (a power of two; 8 per thread at 4 warps), and the
#: warps of a program. Read at each launch (``bench.drift_probe --sweep`` varies them, with
#: ``drift_fused.TRITON_CHUNK``); none of the three changes any element's arithmetic.
BLOCK = 1024
NUM_WARPS = 4
_ROW = 5  # (tensor, start, stop, count_lo, count_hi)


@triton.jit
def _adamw_l1_kernel(
    rows_ptr,
    addrs_ptr,
    acc_ptr,
    decay,
    beta1,
    one_minus_beta1,
    beta2,
    one_minus_beta2,
    eps,
    neg_step_size,
    bias_correction2_sqrt,
    DECAY: tl.constexpr,
    LERP_LOW: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = rows_ptr + tl.program_id(0).to(tl.int64) * 5
    tensor = tl.load(row)
    start = tl.load(row + 1)
    stop = tl.load(row + 2)
    count_lo = tl.load(row + 3)
    count_hi = tl.load(row + 4)
    base = addrs_ptr + tensor * 4
    p_ptr = tl.load(base).to(tl.pointer_type(tl.float32))
    g_ptr = tl.load(base + 1).to(tl.pointer_type(tl.float32))
    m_ptr = tl.load(base + 2).to(tl.pointer_type(tl.float32))
    v_ptr = tl.load(base + 3).to(tl.pointer_type(tl.float32))
    total = tl.zeros([BLOCK], dtype=tl.float32)
    for offset in range(start, stop, BLOCK):
        offs = offset + tl.arange(0, BLOCK)
        inside = offs < stop
        p = tl.load(p_ptr + offs, mask=inside, other=0.0)
        g = tl.load(g_ptr + offs, mask=inside, other=0.0)
        m = tl.load(m_ptr + offs, mask=inside, other=0.0)
        v = tl.load(v_ptr + offs, mask=inside, other=0.0)
        # torch's single-tensor AdamW, op for op (lerp as ATen computes it for the weight's side)
        new = p * decay if DECAY else p
        if LERP_LOW:
            m = m + one_minus_beta1 * (g - m)
        else:
            m = g - (g - m) * beta1
        v = v * beta2 + one_minus_beta2 * g * g
        denom = tl.div_rn(tl.sqrt_rn(v), bias_correction2_sqrt) + eps
        new = new + neg_step_size * tl.div_rn(m, denom)
        tl.store(p_ptr + offs, new, mask=inside)
        tl.store(m_ptr + offs, m, mask=inside)
        tl.store(v_ptr + offs, v, mask=inside)
        counted = inside & (offs >= count_lo) & (offs < count_hi)
        total += tl.where(counted, tl.abs(new - p), 0.0)
    tl.atomic_add(acc_ptr, tl.sum(total, axis=0).to(tl.float64))


@functools.lru_cache(maxsize=1024)
def _rows_on(
    numels: tuple[int, ...], windows: tuple[Windows | None, ...], device: torch.device, chunk: int
) -> torch.Tensor:
    rows = work_rows(numels, windows, chunk)
    return torch.tensor(rows, dtype=torch.int64).reshape(-1, _ROW).to(device)


@functools.lru_cache(maxsize=4096)
def _addrs_on(addrs: tuple[int, ...], device: torch.device) -> torch.Tensor:
    return torch.tensor(addrs, dtype=torch.int64).to(device)


def adamw_l1_triton(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    windows: Sequence[Windows | None],
    scalars: AdamWScalars,
) -> torch.Tensor:
    """One launch: update every tensor in place; the count as a float64 scalar on the device."""
    device = params[0].device
    acc = torch.zeros(1, dtype=torch.float64, device=device)
    rows = _rows_on(tuple(p.numel() for p in params), tuple(windows), device, drift_fused.TRITON_CHUNK)
    if rows.numel() == 0:
        return acc[0]
    addrs = tuple(t.data_ptr() for quad in zip(params, grads, exp_avgs, exp_avg_sqs) for t in quad)
    _adamw_l1_kernel[(rows.shape[0],)](
        rows,
        _addrs_on(addrs, device),
        acc,
        scalars.decay,
        scalars.beta1,
        1 - scalars.beta1,
        scalars.beta2,
        1 - scalars.beta2,
        scalars.eps,
        -scalars.step_size,
        scalars.bias_correction2_sqrt,
        DECAY=scalars.weight_decay != 0,
        LERP_LOW=(1 - scalars.beta1) < 0.5,
        BLOCK=BLOCK,
        num_warps=NUM_WARPS,
    )
    return acc[0]
