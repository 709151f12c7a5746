"""The deterministic, resumable order of training items, shared by every data kind.

Item ``index`` of the endless stream is a pure function of (seed, index): each epoch is a fresh
seeded permutation of the items. Which stream index a rank trains on is a pure function of
(step, micro-step, rank, world size, batch shape), so a recovered run resumes with exactly the
batches it would have seen, with no iterator state to save; the step's RNG seed is one of its
first row (:func:`step_seed`), so it resumes with the same dropout masks too.
"""

from __future__ import annotations

import torch


def first_index(*, step: int, micro: int, rank: int, world_size: int, micro_batch: int, grad_accum: int) -> int:
    """The stream index of the first row rank ``rank`` trains on in micro-step ``micro`` of
    optimizer step ``step`` (steps count from 1): a step's rows are consecutive in the stream,
    so the rows of one step are the same at any world size with the same global batch."""
    global_batch = world_size * micro_batch * grad_accum
    return (step - 1) * global_batch + (micro * world_size + rank) * micro_batch


def step_seed(seed: int, index: int) -> int:
    """The RNG seed of the step whose first row is stream index ``index`` (from
    :func:`first_index`): dropout and any other sampling in a step are a pure function of the
    run's seed and the rows it trains, so a step re-run after a recovery draws what the
    failure-free run drew."""
    return (seed * 1_000_003 + index) % (1 << 63)


class EpochOrder:
    """``order(index)``: the item at position ``index`` of the endless shuffled stream."""

    def __init__(self, count: int, seed: int) -> None:
        if count < 1:
            raise ValueError(f"EpochOrder: needs at least one item, got {count}")
        self.count = count
        self.seed = seed
        self._epoch: int | None = None
        self._order: torch.Tensor | None = None

    def __call__(self, index: int) -> int:
        epoch, position = divmod(index, self.count)
        if epoch != self._epoch:  # one permutation at a time: a resumed run jumps straight to its epoch
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._order = torch.randperm(self.count, generator=generator)
            self._epoch = epoch
        assert self._order is not None
        return int(self._order[position])
