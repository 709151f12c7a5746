"""Training steps ``start..end`` through :func:`layercheck.workers.loop.run_loop`, with failures injected
after chosen steps: the loop is interrupted right after the failing step (its drift report
sent, its decision not yet carried out — as when the process dies there), ``on_failure``
recovers and says where to resume, and the loop goes on from there. Each failure fires once.

A failure is a fail-stop of one rank (``lost_rank``, by default the last): that rank's own code
runs nothing more (:class:`RankLost`), while on the survivors the step raises as a collective
does when a peer dies (:class:`InjectedFailure`), so the loop's failure path runs there — a
survivor's capture, where the coordinator has one (:meth:`layercheck.workers.loop.StepProtocol.on_failure`).
Then, as Ray Train does, the whole group restarts: ``on_failure`` runs on every rank.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection

from layercheck.workers.coordinator import Coordinator
from layercheck.workers.data.dataset import SequenceDataset
from layercheck.workers.engine import TrainEngine
from layercheck.workers.loop import run_loop

logger = logging.getLogger(__name__)


class InjectedFailure(Exception):
    """A survivor's step raised after ``step``: a peer died (its state is lost with the group)."""

    def __init__(self, step: int) -> None:
        super().__init__(f"injected failure after step {step}")
        self.step = step


class RankLost(BaseException):
    """This rank died after ``step``. A ``BaseException``, as ``SystemExit`` is, so no handler of
    the loop runs on it (a dead process hands nothing over)."""

    def __init__(self, step: int) -> None:
        super().__init__(f"rank lost after step {step}")
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
    lost_rank: int | None = None,
) -> list[int]:
    """Train, failing after each step of ``fail_after``: rank ``lost_rank`` (``None``: the last)
    dies, the others survive; ``on_failure(t_fail)`` (every rank) returns the step to resume at.
    Returns the steps at which failures fired."""
    pending = set(fail_after)
    if pending and on_failure is None:
        raise ValueError("train_with_failures: fail_after needs on_failure")
    lost = world_size - 1 if lost_rank is None else lost_rank
    if not 0 <= lost < world_size:
        raise ValueError(f"train_with_failures: lost_rank must be in [0, {world_size}), got {lost_rank}")
    fired: list[int] = []

    def hook(step: int) -> None:
        after_step(step)
        if step in pending:
            pending.discard(step)
            raise RankLost(step) if rank == lost else InjectedFailure(step)

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
        except (InjectedFailure, RankLost) as failure:
            fired.append(failure.step)
            logger.warning(
                "rank %d: %s after step %d", rank, "lost" if isinstance(failure, RankLost) else "failure", failure.step
            )
            assert on_failure is not None
            start = on_failure(failure.step)
    return fired


def wipe_training_state(train_engine: TrainEngine) -> None:
    """What a failure takes (the whole group restarts): every layer's weights and moments become
    NaN (a layer a recovery misses shows up as a NaN loss) and the engine goes back to step 0."""
    import math

    import torch

    from layercheck.workers.engine import seek_step
    from layercheck.workers.layer_state import LayerMeta, restore_layers

    metas = {name: LayerMeta(optimizer_step=0) for name in train_engine.layer_map.names}
    restore_layers(train_engine.layout, metas, lambda name, key, offset, length: torch.full((length,), math.nan))
    seek_step(train_engine, 0)
