"""The learning-rate schedule as a pure function of the step, and the scheduler that applies it.

``lr_at(step)`` is the learning rate the optimizer uses for its ``step + 1``-th update, i.e.
after ``step`` updates have been applied. The policy scales its thresholds by it and recovery
re-enters it at any step, so it has no hidden state.
"""

from __future__ import annotations

import logging
import math
import warnings
from functools import partial
from typing import Protocol

import torch

from layercheck.workers.config import OptimConfig

logger = logging.getLogger(__name__)


def lr_factor(step: int, cfg: OptimConfig) -> float:
    """``lr_at(step) / cfg.lr``: linear warm-up to 1, then decay to ``cfg.min_lr_ratio``."""
    if step < 0:
        raise ValueError(f"step must be non-negative, got {step}")
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return 1.0
    span = max(1, cfg.total_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    if cfg.schedule == "linear":
        shape = 1.0 - progress
    else:
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * shape


def lr_at(step: int, cfg: OptimConfig) -> float:
    """The learning rate of the update made after ``step`` updates."""
    return cfg.lr * lr_factor(step, cfg)


class StepSchedule(torch.optim.lr_scheduler.LambdaLR):
    """A ``LambdaLR`` following :func:`lr_factor`, which can be put at any step at once."""

    def seek(self, step: int) -> None:
        """Put the schedule where it is after ``step`` updates, setting every group's lr."""
        self.last_epoch = step
        lrs = [base * fn(step) for base, fn in zip(self.base_lrs, self.lr_lambdas)]
        for group, lr in zip(self.optimizer.param_groups, lrs):
            group["lr"] = lr
        self._last_lr = lrs  # what get_last_lr() reports


class SteppedSchedule(Protocol):
    """What :func:`seek_scheduler` moves: torch's ``LRScheduler`` (``step()``) and DeepSpeed's own
    schedulers (``step(last_batch_iteration)``) both have it."""

    def step(self, epoch: int | None = None, /) -> object: ...


def make_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig) -> StepSchedule:
    """The built-in loop's schedule (every group starts at its own lr, scaled by :func:`lr_factor`)."""
    return StepSchedule(optimizer, partial(lr_factor, cfg=cfg))


def seek_scheduler(scheduler: SteppedSchedule | None, step: int) -> None:
    """Move a scheduler to ``step`` updates: a :class:`StepSchedule` is set there at once;
    DeepSpeed's own schedulers (``last_batch_iteration``) jump there; any other torch scheduler,
    fresh, is stepped ``step`` times, which is what training would have done. ``None``: nothing."""
    if scheduler is None:
        return
    if isinstance(scheduler, StepSchedule):
        scheduler.seek(step)
    elif step == 0:
        return
    elif hasattr(scheduler, "last_batch_iteration"):  # deepspeed.runtime.lr_schedules
        scheduler.step(step - 1)
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "lr_scheduler.step() before optimizer.step()"
            for _ in range(step):
                scheduler.step()
