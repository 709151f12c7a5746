"""Where a Hugging Face ``Trainer`` resumes: its step counter and its data position at ``t_fail``.

The ``Trainer`` fast-forwards its data only when it resumes from a checkpoint folder of its own
(``train(resume_from_checkpoint=...)``), and with DeepSpeed that folder must hold a full DeepSpeed
checkpoint, which is what LayerCheck replaces. So a restarted worker group starts the ``Trainer``
fresh, and LayerCheck moves it before the first step, from ``on_train_begin``: ``state.global_step``
to ``t_fail``, and the train data loader (Accelerate's ``DataLoaderShard``, the object the
``Trainer`` iterates) to the batch the failure-free run would take next. That loader skips the
``t_fail``-th step's batches of the current epoch with its own ``skip_batches`` (what Accelerate's
``skip_first_batches`` sets, the mechanism the ``Trainer``'s own resume uses), and the epochs
already trained are added to the epoch the ``Trainer`` passes to ``set_epoch``, so the shuffled
order of every later epoch is the failure-free one. Nothing here talks to DeepSpeed or Ray.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from accelerate.data_loader import DataLoaderShard

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class DataPosition:
    """Where the failure-free run's data stood after ``step`` optimizer steps."""

    step: int
    """Optimizer steps already trained (``t_fail``)."""
    epochs_done: int
    """Whole epochs those steps used."""
    batches_to_skip: int
    """Batches of the next epoch those steps used (micro-batches: steps × gradient accumulation)."""
    exact: bool
    """False when the epoch's batch count is not a multiple of the gradient accumulation: the
    ``Trainer`` then groups the last micro-batches of the first resumed epoch differently."""

    def __post_init__(self) -> None:
        for name in ("step", "epochs_done", "batches_to_skip"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: must be >= 0, got {getattr(self, name)}")


def data_position(step: int, *, batches_per_epoch: int, grad_accum: int) -> DataPosition:
    """The data position after ``step`` optimizer steps, counted as the ``Trainer`` counts them
    (``num_update_steps_per_epoch``: the last step of an epoch takes what is left)."""
    if batches_per_epoch < 1 or grad_accum < 1:
        raise ValueError(f"batches_per_epoch and grad_accum: must be >= 1, got {batches_per_epoch}, {grad_accum}")
    steps_per_epoch = max(-(-batches_per_epoch // grad_accum), 1)
    epochs_done, steps_in = divmod(step, steps_per_epoch)
    return DataPosition(
        step=step,
        epochs_done=epochs_done,
        batches_to_skip=steps_in * grad_accum,
        exact=batches_per_epoch % grad_accum == 0,
    )


class DataSeek:
    """A train data loader moved to a :class:`DataPosition`; :meth:`epoch_ended` after each epoch."""

    def __init__(self, loader: DataLoaderShard, position: DataPosition) -> None:
        if not hasattr(loader, "skip_batches") or not hasattr(loader, "set_epoch"):
            raise TypeError(
                "LayerCheck resumes the Trainer's data through Accelerate's data loader (skip_batches, "
                f"set_epoch); the Trainer's train data loader is a {type(loader).__name__}. Use the "
                "Trainer's own get_train_dataloader (a custom one must return an accelerator-prepared "
                "loader)"
            )
        self.loader = loader
        self.position = position
        self._first_epoch = True
        if position.epochs_done:
            _offset_epochs(loader, position.epochs_done)
        loader.skip_batches = position.batches_to_skip
        if not position.exact:
            logger.warning(
                "the epoch's batch count is not a multiple of gradient_accumulation_steps: the first "
                "resumed epoch's last optimizer step groups its micro-batches differently from the "
                "failure-free run"
            )
        logger.info(
            "train data moved to step %d: epoch %d, %d batches skipped",
            position.step,
            position.epochs_done,
            position.batches_to_skip,
        )

    def epoch_ended(self) -> None:
        """The first resumed epoch is over: later epochs start at their first batch."""
        if self._first_epoch:
            self._first_epoch = False
            self.loader.skip_batches = 0

    def epoch_progress(self, trainer_epoch: float) -> float:
        """The failure-free run's ``state.epoch`` for the ``Trainer``'s count ``trainer_epoch``
        (the ``Trainer`` counts the resumed epochs from 0 and the skipped batches not at all)."""
        skipped = self.position.batches_to_skip / len(self.loader) if self._first_epoch else 0.0
        return trainer_epoch + self.position.epochs_done + skipped


def _offset_epochs(loader: DataLoaderShard, offset: int) -> None:
    """Make ``loader.set_epoch(e)`` seed the shuffle with epoch ``e + offset`` while the loader
    still counts ``e`` (its ``__iter__`` calls ``set_epoch(self.iteration)`` again)."""
    original = loader.set_epoch

    def set_epoch(epoch: int) -> None:
        original(epoch + offset)
        loader.iteration = epoch

    loader.set_epoch = set_epoch
