"""The stream order and the per-step RNG seed are pure functions of (seed, position)."""

from __future__ import annotations

import torch

from layercheck.workers.data.order import EpochOrder, first_index, step_seed


def test_a_steps_rows_are_the_same_at_any_world_size_with_the_same_global_batch():
    rows = {
        world: sorted(
            first_index(step=3, micro=m, rank=r, world_size=world, micro_batch=8 // world, grad_accum=2) + i
            for m in range(2)
            for r in range(world)
            for i in range(8 // world)
        )
        for world in (1, 2, 4)
    }
    assert rows[1] == rows[2] == rows[4] == list(range(32, 48))


def test_the_epoch_order_is_a_permutation_per_epoch_and_resumes_anywhere():
    order = EpochOrder(5, seed=7)
    first, second = [order(i) for i in range(5)], [order(i) for i in range(5, 10)]
    assert sorted(first) == sorted(second) == list(range(5))
    assert [EpochOrder(5, seed=7)(i) for i in range(7, 10)] == second[2:]  # a resumed run jumps in


def test_a_step_seed_gives_the_same_dropout_mask_however_the_rng_was_used_before():
    dropout = torch.nn.Dropout(0.5)
    torch.manual_seed(step_seed(3, 128))
    mask = dropout(torch.ones(64))
    torch.rand(1000)  # a different history (a recovered process, another strategy)
    torch.manual_seed(step_seed(3, 128))
    assert torch.equal(dropout(torch.ones(64)), mask)
    torch.manual_seed(step_seed(3, 129))
    assert not torch.equal(dropout(torch.ones(64)), mask)  # the next rows draw afresh
    assert step_seed(0, 0) != step_seed(1, 0) and 0 <= step_seed(2**40, 2**40) < 1 << 63
