"""What one fused AdamW-and-drift step works on: its per-step scalars, its groups of tensors,
the windows of each tensor that count towards drift, and the Triton kernel's table of work rows.

Both paths of the fused step read these (:mod:`layercheck.workers.drift.fused`, the torch path
and the dispatcher; :mod:`layercheck.workers.drift.triton_step`, the kernel), so they live here, below
both, and neither module imports the other at its top.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

if TYPE_CHECKING:
    from layercheck.workers.drift.local import LocalTensors

#: (start, length) runs of a tensor's flattened elements that count towards drift.
Windows = tuple[tuple[int, int], ...]

#: Elements one Triton program updates (a row of the work table; it loops over them in blocks).
TRITON_CHUNK = 1 << 14


class AdamWScalars(NamedTuple):
    """The per-step scalars of one AdamW update at step count ``step`` (1 for the first step).
    A named tuple: the fused step makes one per param group and step (a frozen dataclass cost
    four times as much to build, 2 µs each)."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    step: float

    @classmethod
    def of_group(cls, group: dict[str, Any], count: float) -> AdamWScalars:
        """The scalars of torch param group ``group``'s step at step count ``count``."""
        beta1, beta2 = group["betas"]
        # positional, in the fields' order: with keywords it took twice as long (1.2 µs; 50 groups a step)
        return cls(group["lr"], beta1, beta2, group["eps"], group["weight_decay"], count)

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


def to_device(table: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``table`` (host) on ``device``. To a GPU through pinned memory without blocking: a copy
    from pageable memory waits for the stream, all of the step's queued work, before it.
    torch's pinned-memory cache keeps the block until the copy has run."""
    if device.type != "cuda":
        return table.to(device)
    pinned = torch.empty(table.shape, dtype=table.dtype, pin_memory=True)
    pinned.copy_(table)
    return pinned.to(device, non_blocking=True)


def only_grads_moved(known: Sequence[Sequence[int]] | None, addrs: Sequence[Sequence[int]]) -> bool:
    """Whether the addresses ``addrs`` of a kept plan's tensors (a list per role: params, grads,
    exp_avgs, exp_avg_sqs) differ from ``known`` in the gradients alone: new gradient tensors, as
    a loop that sets them to ``None`` (or DeepSpeed's fp32 copies of bf16 ones) brings each step."""
    return known is not None and known[0] == addrs[0] and known[2:] == addrs[2:] and known[1] != addrs[1]


def counted_runs(numel: int, windows: Windows | None) -> Windows:
    """The runs of a tensor that count: ``windows``, or all of it when it has none."""
    return ((0, numel),) if windows is None else windows


def work_rows(
    numels: Sequence[int], windows: Sequence[Windows | None], chunk: int
) -> list[tuple[int, int, int, int, int, int]]:
    """The Triton kernel's work table: rows ``(tensor, start, stop, count_lo, count_hi, run)``.

    Each row updates elements ``[start, stop)`` of one tensor (at most ``chunk`` of them) and
    counts those in ``[count_lo, count_hi)``, which lie in the tensor's ``run``-th counted window
    (0 when the row counts nothing). The rows of a tensor partition it, so every element is
    updated exactly once; a chunk that meets several counted runs is split at their edges so
    that each row meets at most one.
    """
    if chunk <= 0:
        raise ValueError(f"chunk must be positive, got {chunk}")
    rows: list[tuple[int, int, int, int, int, int]] = []
    for index, (numel, tensor_windows) in enumerate(zip(numels, windows)):
        runs = sorted((s, s + n, k) for k, (s, n) in enumerate(counted_runs(numel, tensor_windows)) if n > 0)
        for start in range(0, numel, chunk):
            stop = min(start + chunk, numel)
            inside = [(max(lo, start), min(hi, stop), k) for lo, hi, k in runs if lo < stop and hi > start]
            if len(inside) <= 1:
                lo, hi, k = inside[0] if inside else (start, start, 0)
                rows.append((index, start, stop, lo, hi, k))
                continue
            edges = [start] + [lo for lo, _, _ in inside[1:]] + [stop]
            for (a, b), (lo, hi, k) in zip(zip(edges, edges[1:]), inside):
                rows.append((index, a, b, lo, hi, k))
    return rows


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


@dataclass(frozen=True, kw_only=True)
class LayerStep:
    """Tensors stepped together whose windows count into several accumulators (the layers of
    flat partitions): tensor ``i`` steps with ``scalars[slots[i]]``, and its window ``k``
    (``windows[i][k]``) counts into accumulator ``accumulators[i][k]`` of ``count``."""

    params: Sequence[torch.Tensor]
    grads: Sequence[torch.Tensor]
    exp_avgs: Sequence[torch.Tensor]
    exp_avg_sqs: Sequence[torch.Tensor]
    windows: Sequence[Windows]
    accumulators: Sequence[Sequence[int]]
    slots: Sequence[int]
    scalars: Sequence[AdamWScalars]
    count: int

    def tensors(self) -> list[torch.Tensor]:
        return [*self.params, *self.grads, *self.exp_avgs, *self.exp_avg_sqs]


@dataclass(eq=False, kw_only=True)
class FusedPlan:
    """The tensors of a fused step over one set of param groups, kept from step to step.

    Building a step's work from its param groups costs the host more than the kernel's launch
    (per tensor: its state, windows, pointers); kept here, a step only checks that nothing changed
    (``DriftAdamW._plan_holds``; new windows or param groups drop every plan) and reads what does change:
    gradients, step counts and hyper-parameters. Each param group is a *slot*; its tensors are
    ``params[starts[slot]:starts[slot + 1]]``."""

    names: tuple[str, ...]
    """Each slot's param group name."""
    starts: tuple[int, ...]
    """Each slot's first tensor, and the number of tensors at the end."""
    params: list[torch.Tensor]
    """The tensors stepped: the optimizer's own, or their local shards (see ``sources``)."""
    states: list[dict[str, Any]]
    exp_avgs: list[torch.Tensor]
    exp_avg_sqs: list[torch.Tensor]
    windows: list[Windows | None]
    owned: tuple[bool, ...]
    """Whether a slot has a counted element (one without reports no drift, as the foreach step)."""
    state_table: object
    """The optimizer's ``state`` mapping it was built from (``load_state_dict`` replaces it): only
    compared by identity."""
    state_entries: tuple[list[torch.Tensor], list[object]] = field(default_factory=lambda: ([], []))
    """That mapping's keys and values, in order, as last seen holding ``states``: while they are
    the same objects, no parameter's state was replaced (``DriftAdamW._plan_holds``)."""
    triton: bool | None = None
    """Whether the Triton kernel takes every tensor (decided at the first launch; again for the
    gradients alone when only theirs are new; again for all, with the launcher's tables dropped,
    when a tensor's storage was swapped under it); ``False`` stays: the torch path."""
    tables: dict[Any, Any] = field(default_factory=dict)
    """The launcher's cache: the work table per chunk size, the address table and its addresses
    (a list per role: params, grads, exp_avgs, exp_avg_sqs)."""
    sources: tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]] | None = None
    """Where the optimizer holds DTensors (FSDP2): its params, exp_avgs and exp_avg_sqs, whose
    local shards the fields above are; ``None``: they are the optimizer's own tensors."""
    local_params: LocalTensors | None = None
    """With ``sources``: which local shard each param holds, to notice FSDP2 swapping one (the
    plan then holds no longer)."""

    def keys(self) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
        """The optimizer's own params, exp_avgs and exp_avg_sqs, as the plan was built over them."""
        return self.sources or (self.params, self.exp_avgs, self.exp_avg_sqs)

    def slot_counts(self, counts: Sequence[float]) -> list[float] | None:
        """Each slot's step count, given every tensor's; ``None`` when a slot's tensors differ
        (then its parts step apart: :func:`layercheck.workers.drift.adamw._by_count`)."""
        if counts.count(counts[0]) == len(counts):  # the usual case: one count for all
            return [counts[0]] * len(self.names)
        out = []
        for start, stop in zip(self.starts, self.starts[1:]):
            part = counts[start:stop]
            if part.count(part[0]) != len(part):
                return None
            out.append(part[0])
        return out

    def tensor_lists(self, grads: Sequence[torch.Tensor]) -> tuple[Sequence[torch.Tensor], ...]:
        """The kernel's four tensors per entry: params, ``grads``, exp_avgs, exp_avg_sqs."""
        return (self.params, grads, self.exp_avgs, self.exp_avg_sqs)

    def tensor_slots(self) -> list[int]:
        """Each tensor's slot."""
        return [slot for slot, (a, b) in enumerate(zip(self.starts, self.starts[1:])) for _ in range(a, b)]
