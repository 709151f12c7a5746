"""Training steps ``start..end`` through :func:`workers.loop.run_loop`, with failures injected
after chosen steps: the loop is interrupted right after the failing step (its drift report
sent, its decision not yet carried out — as when the process dies there), ``on_failure``
recovers and says where to resume, and the loop goes on from there. Each failure fires once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection

from workers.data import SequenceDataset
from workers.engine import TrainEngine
from workers.loop import Coordinator, run_loop

logger = logging.getLogger(__name__)


class InjectedFailure(Exception):
    """The rank's in-memory training state is lost after ``step``."""

    def __init__(self, step: int) -> None:
        super().__init__(f"injected failure after step {step}")
        self.step = step


def train_with_failures(
    train_engine: TrainEngine,
    dataset: SequenceDataset,
    coordinator: Coordinator,
    *,
    start_step: int,
    end_step: int,
    rank: int,
    world_size: int,
    fail_after: Collection[int] = (),
    on_failure: Callable[[int], int] | None = None,
    after_step: Callable[[int], None] = lambda step: None,
) -> list[int]:
    """Train, failing after each step of ``fail_after``; ``on_failure(t_fail)`` returns the
    step to resume at. Returns the steps at which failures fired."""
    pending = set(fail_after)
    if pending and on_failure is None:
        raise ValueError("train_with_failures: fail_after needs on_failure")
    fired: list[int] = []

    def hook(step: int) -> None:
        after_step(step)
        if step in pending:
            pending.discard(step)
            raise InjectedFailure(step)

    start = start_step
    while start <= end_step:
        try:
            run_loop(
                train_engine,
                dataset,
                coordinator,
                start_step=start,
                end_step=end_step,
                rank=rank,
                world_size=world_size,
                after_step=hook,
            )
            break
        except InjectedFailure as failure:
            fired.append(failure.step)
            logger.warning("rank %d: failure after step %d", rank, failure.step)
            assert on_failure is not None
            start = on_failure(failure.step)
    return fired


def wipe_training_state(train_engine: TrainEngine) -> None:
    """What a failure takes: every layer's weights and moments become NaN (a layer a recovery
    misses shows up as a NaN loss) and the engine goes back to step 0."""
    import math

    import torch

    from workers.engine import seek_step
    from workers.layer_state import LayerMeta, restore_layers

    metas = {name: LayerMeta(optimizer_step=0) for name in train_engine.layer_map.names}
    restore_layers(train_engine.layout, metas, lambda name, key, offset, length: torch.full((length,), math.nan))
    seek_step(train_engine, 0)
