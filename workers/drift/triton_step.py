"""The Triton kernel of DriftAdamW's fused step (CUDA): AdamW and the drift count in one pass.

Imported only by :mod:`layercheck.workers.drift.fused` (``adamw_l1_groups``, ``adamw_l1_plan``)
once it has seen CUDA tensors and an importable Triton, so a CPU machine never imports Triton.
Under ``TRITON_INTERPRET=1`` the same kernel runs on CPU tensors (Triton's interpreter), which is
how its arithmetic is tested without a GPU (``tests/workers/test_drift_fused.py``).

One launch covers a whole optimizer step: every param group and step count is a *slot* with its
own AdamW scalars (a row of a float32 table) and its own float64 accumulator. A work table (see
:func:`layercheck.workers.drift.fused_work.work_rows`) gives each program a chunk of one tensor and its slot, and
an address table gives each tensor's ``param, grad, exp_avg, exp_avg_sq`` pointers. Each program
reads the four once, writes three, and adds ``sum |new - old|`` of its counted elements to its
slot's accumulator with one atomic add. Measured on an H200 (``layercheck.bench.drift_probe --sweep``), a
launch per group left the step CPU-bound on issuing 50 launches; one launch per step is issued
once. DriftAdamW keeps a step's tensors in a plan (:class:`~layercheck.workers.drift.fused_work.FusedPlan`)
and with it the work table, built once, and the address table, built again only when an address
changes (new gradients); the scalar table changes with the learning rate and is copied each step.

Scalars are read from the tables as small vectors and picked out with a reduction, and a program
loops over a fixed ``CHUNK`` (masked past its row's end) rather than to a loaded bound: Triton's
interpreter gives every scalar a shape of ``[1]``, which a loop bound cannot take.
"""

# no ``from __future__ import annotations``: Triton reads ``tl.constexpr`` annotations as objects

import functools
import logging
from array import array
from collections.abc import Sequence
from itertools import chain

import torch
import triton
import triton.language as tl

from layercheck.workers.drift import fused_work as drift_fused_work
from layercheck.workers.drift.fused_work import (
    AdamWScalars,
    FusedGroup,
    FusedPlan,
    LayerStep,
    Windows,
    only_grads_moved,
    to_device,
    work_rows,
)

logger = logging.getLogger(__name__)

#: Elements per loop iteration of a program (a power of two; 8 per thread at 4 warps), and the
#: warps of a program. Read at each launch (``layercheck.bench.drift_probe --sweep`` varies them, with
#: ``drift_fused_work.TRITON_CHUNK``); none of the three changes any element's arithmetic.
BLOCK = 1024
NUM_WARPS = 4

# The widths of the kernel's tables, each a power of two for tl.arange (passed in as constexprs)
ROW = 8  # (tensor, start, stop, count_lo, count_hi, slot, accumulator, -)
ADDRS = 4  # param, grad, exp_avg, exp_avg_sq
SCALARS = 16  # decay, beta1, 1 - beta1, beta2, 1 - beta2, eps, -step_size, sqrt(bias corr. 2), lerp_low


@triton.jit
def _pick_int(values, index, k):
    return tl.sum(tl.where(index == k, values, 0), axis=0)


@triton.jit
def _pick_float(values, index, k):
    # min, not sum: a -0.0 must stay -0.0 (-0.0 + 0.0 is +0.0)
    return tl.min(tl.where(index == k, values, float("inf")), axis=0)


@triton.jit
def _adamw_l1_kernel(
    rows_ptr,
    addrs_ptr,
    scalars_ptr,
    acc_ptr,
    CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,
    ROW: tl.constexpr,
    ADDRS: tl.constexpr,
    SCALARS: tl.constexpr,
):
    row_index = tl.arange(0, ROW)
    row = tl.load(rows_ptr + tl.program_id(0).to(tl.int64) * ROW + row_index)
    tensor = _pick_int(row, row_index, 0)
    start = _pick_int(row, row_index, 1)
    stop = _pick_int(row, row_index, 2)
    count_lo = _pick_int(row, row_index, 3)
    count_hi = _pick_int(row, row_index, 4)
    slot = _pick_int(row, row_index, 5)
    acc = _pick_int(row, row_index, 6)
    addr_index = tl.arange(0, ADDRS)
    addrs = tl.load(addrs_ptr + tensor * ADDRS + addr_index)
    p_ptr = _pick_int(addrs, addr_index, 0).to(tl.pointer_type(tl.float32))
    g_ptr = _pick_int(addrs, addr_index, 1).to(tl.pointer_type(tl.float32))
    m_ptr = _pick_int(addrs, addr_index, 2).to(tl.pointer_type(tl.float32))
    v_ptr = _pick_int(addrs, addr_index, 3).to(tl.pointer_type(tl.float32))
    scalar_index = tl.arange(0, SCALARS)
    scalars = tl.load(scalars_ptr + slot * SCALARS + scalar_index)
    decay = _pick_float(scalars, scalar_index, 0)
    beta1 = _pick_float(scalars, scalar_index, 1)
    one_minus_beta1 = _pick_float(scalars, scalar_index, 2)
    beta2 = _pick_float(scalars, scalar_index, 3)
    one_minus_beta2 = _pick_float(scalars, scalar_index, 4)
    eps = _pick_float(scalars, scalar_index, 5)
    neg_step_size = _pick_float(scalars, scalar_index, 6)
    bias_correction2_sqrt = _pick_float(scalars, scalar_index, 7)
    lerp_low = _pick_float(scalars, scalar_index, 8) != 0.0
    total = tl.zeros([BLOCK], dtype=tl.float32)
    for offset in range(0, CHUNK, BLOCK):  # a row holds at most CHUNK elements; the rest is masked
        offs = start + offset + tl.arange(0, BLOCK)
        inside = offs < stop
        p = tl.load(p_ptr + offs, mask=inside, other=0.0)
        g = tl.load(g_ptr + offs, mask=inside, other=0.0)
        m = tl.load(m_ptr + offs, mask=inside, other=0.0)
        v = tl.load(v_ptr + offs, mask=inside, other=0.0)
        # torch's single-tensor AdamW, op for op (lerp as ATen computes it for the weight's side);
        # a group without weight decay has decay 1.0, and p * 1.0 is p exactly
        new = p * decay
        m = tl.where(lerp_low, m + one_minus_beta1 * (g - m), g - (g - m) * beta1)
        v = v * beta2 + one_minus_beta2 * g * g
        denom = tl.div_rn(tl.sqrt_rn(v), bias_correction2_sqrt) + eps
        new = new + neg_step_size * tl.div_rn(m, denom)
        tl.store(p_ptr + offs, new, mask=inside)
        tl.store(m_ptr + offs, m, mask=inside)
        tl.store(v_ptr + offs, v, mask=inside)
        counted = inside & (offs >= count_lo) & (offs < count_hi)
        total += tl.where(counted, tl.abs(new - p), 0.0)
    tl.atomic_add(acc_ptr + acc, tl.sum(total, axis=0).to(tl.float64))


@functools.lru_cache(maxsize=256)
def _rows_on(
    numels: tuple[int, ...],
    windows: tuple[Windows | None, ...],
    slots: tuple[int, ...],
    device: torch.device,
    chunk: int,
    accumulators: tuple[tuple[int, ...], ...] | None = None,
) -> torch.Tensor:
    """The work table on ``device``: each row's scalar slot (its tensor's), and the accumulator its
    count goes to: the slot's, or ``accumulators[tensor][run]`` (a layer's, in a flat partition;
    a tensor with no counted window names none)."""
    rows = [
        (t, start, stop, lo, hi, slots[t], slots[t] if accumulators is None else (accumulators[t] or (0,))[run], 0)
        for t, start, stop, lo, hi, run in work_rows(numels, windows, chunk)
    ]
    return torch.tensor(rows, dtype=torch.int64).reshape(-1, ROW).to(device)


@functools.lru_cache(maxsize=1024)
def _addrs_on(addrs: tuple[int, ...], device: torch.device) -> torch.Tensor:
    return to_device(_int64(addrs), device)


def scalar_row(s: AdamWScalars) -> list[float]:
    """One slot's row of the scalar table (float32 on the device, as Triton takes a float argument)."""
    decay = s.decay if s.weight_decay != 0 else 1.0
    lerp_low = 1.0 if (1 - s.beta1) < 0.5 else 0.0
    row = [decay, s.beta1, 1 - s.beta1, s.beta2, 1 - s.beta2, s.eps, -s.step_size, s.bias_correction2_sqrt, lerp_low]
    return row + [0.0] * (SCALARS - len(row))


def adamw_l1_triton_plan(plan: FusedPlan, addrs: list[list[int]], scalars: Sequence[AdamWScalars]) -> torch.Tensor:
    """One launch for a kept plan, ``addrs`` its tensors' addresses this step, a list per role
    (params, grads, exp_avgs, exp_avg_sqs; see :func:`layercheck.workers.drift.fused.adamw_l1_plan`):
    the work table is built once per chunk size, the address table again only when an address changed."""
    device = plan.params[0].device
    acc = torch.zeros(len(plan.names), dtype=torch.float64, device=device)
    tables = plan.tables
    chunk = drift_fused_work.TRITON_CHUNK
    rows = tables.get(("rows", chunk))
    if rows is None:
        numels = tuple(map(torch.Tensor.numel, plan.params))
        rows = tables["rows", chunk] = _rows_on(numels, tuple(plan.windows), tuple(plan.tensor_slots()), device, chunk)
    if rows.numel() == 0:
        return acc
    known = tables.get("addrs")
    if addrs != known:  # the kernel's rows: each tensor's four addresses in turn, kept on the host too
        if only_grads_moved(known, addrs):  # a column anew, not the table (151 against 25 µs, 290 tensors)
            host = tables["addr_host"]
            host.view(-1, ADDRS)[:, 1] = _int64(addrs[1])
        else:
            host = torch.stack([_int64(column) for column in addrs], dim=1).view(-1)
        tables["addrs"], tables["addr_host"], tables["addr_table"] = addrs, host, to_device(host, device)
    _launch(rows, tables["addr_table"], _scalar_table(scalars, device), acc, chunk)
    return acc


@functools.lru_cache(maxsize=256)
def _scalar_bytes(s: AdamWScalars) -> bytes:
    """:func:`scalar_row` as float32 bytes, rounded as ``torch.tensor`` would. Kept: a step's slots
    mostly share their scalars (the 0.5B shape's 50 have two rows), and only a new step count or
    learning rate makes a row anew. (A tensor learning rate, which torch's schedulers change in
    place, keys by its object: its row is reused only at a step count seen before, after a restore.)"""
    return array("f", scalar_row(s)).tobytes()


def _int64(values: Sequence[int]) -> torch.Tensor:
    """``values`` as an int64 tensor, through an ``array`` (``torch.tensor`` of Python ints is slower)."""
    return torch.frombuffer(array("q", values), dtype=torch.int64)


def _scalar_table(scalars: Sequence[AdamWScalars], device: torch.device) -> torch.Tensor:
    """The scalar table on ``device``, joined from each slot's bytes (from 50 rows of floats
    through an ``array`` it took 8x as long on the host: 138 against 17 µs)."""
    flat = bytearray(b"".join(map(_scalar_bytes, scalars)))
    return to_device(torch.frombuffer(flat, dtype=torch.float32).view(len(scalars), SCALARS), device)


def _launch(rows: torch.Tensor, addrs: torch.Tensor, scalars: torch.Tensor, acc: torch.Tensor, chunk: int) -> None:
    _adamw_l1_kernel[(rows.shape[0],)](
        rows,
        addrs,
        scalars,
        acc,
        CHUNK=chunk,
        BLOCK=BLOCK,
        ROW=ROW,
        ADDRS=ADDRS,
        SCALARS=SCALARS,
        num_warps=NUM_WARPS,
    )


def adamw_l1_triton_groups(groups: Sequence[FusedGroup]) -> torch.Tensor:
    """One launch for every group: update each tensor in place; each group's count as a float64
    on the device (a vector, one entry per group)."""
    device = groups[0].params[0].device
    acc = torch.zeros(len(groups), dtype=torch.float64, device=device)
    data_ptr = torch.Tensor.data_ptr
    numels: list[int] = []
    windows: list[Windows | None] = []
    slots: list[int] = []
    addrs: list[int] = []  # per tensor: param, grad, exp_avg, exp_avg_sq (the kernel's address rows)
    for slot, group in enumerate(groups):
        numels.extend(map(torch.Tensor.numel, group.params))
        windows.extend(group.windows)
        slots.extend([slot] * len(group.params))
        quads = zip(*(map(data_ptr, ts) for ts in (group.params, group.grads, group.exp_avgs, group.exp_avg_sqs)))
        addrs.extend(chain.from_iterable(quads))
    chunk = drift_fused_work.TRITON_CHUNK
    rows = _rows_on(tuple(numels), tuple(windows), tuple(slots), device, chunk)
    if rows.numel() == 0:
        return acc
    _launch(rows, _addrs_on(tuple(addrs), device), _scalar_table([g.scalars for g in groups], device), acc, chunk)
    return acc


def adamw_l1_triton_layers(step: LayerStep) -> torch.Tensor:
    """One launch over ``step``'s tensors, each row counting into its window's accumulator (see
    :func:`layercheck.workers.drift.fused.adamw_l1_layers`): the accumulators, float64 on the device."""
    device = step.params[0].device
    acc = torch.zeros(step.count, dtype=torch.float64, device=device)
    chunk = drift_fused_work.TRITON_CHUNK
    numels = tuple(map(torch.Tensor.numel, step.params))
    accs = tuple(map(tuple, step.accumulators))
    rows = _rows_on(numels, tuple(step.windows), tuple(step.slots), device, chunk, accs)
    if rows.numel() == 0:
        return acc
    quads = zip(*(map(torch.Tensor.data_ptr, ts) for ts in (step.params, step.grads, step.exp_avgs, step.exp_avg_sqs)))
    _launch(rows, _addrs_on(tuple(chain.from_iterable(quads)), device), _scalar_table(step.scalars, device), acc, chunk)
    return acc
