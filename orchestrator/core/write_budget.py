"""The write budget a schedule plans under: bytes per step the writers can drain.

Every report round carries each writer's running totals (bytes written, seconds spent writing)
and the step time; :class:`DrainBudget` turns them into ``budget = headroom × drain bandwidth ×
step time`` (capped), which the policy service puts on the step's
:class:`~policies.decision.StepObservation` as ``write_budget_bytes``. A budget-aware schedule
(``staggered``) stretches its periods when storage is slower than its plan, so the queue of
snapshots cannot grow without bound; policies without a budget ignore it.

The bandwidth is the sum over writers (they write in parallel) of each one's EMA of
``Δbytes / Δwrite-seconds`` between rounds. Pure and deterministic in its inputs: the local
runtime feeds every rank's replica the same gathered totals, so every replica decides alike.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from policies.config_loader import require, require_finite

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class WriteBudgetConfig:
    """How the writers' measured drain bandwidth becomes the schedule's byte budget per step."""

    headroom: float = 0.8
    """Fraction of the measured drain bandwidth the schedule may plan to use (the rest absorbs
    bursts and slow writes), in (0, 1]."""
    ema: float = 0.8
    """Smoothing of each writer's bandwidth per new measurement (exponential moving average), in [0, 1)."""
    cap_bytes_per_step: int | None = None
    """Upper bound on the budget whatever the bandwidth (e.g. to share storage); ``None``: none."""

    def __post_init__(self) -> None:
        require_finite(self)
        require(0 < self.headroom <= 1, "headroom", "in (0, 1]", self.headroom)
        require(0 <= self.ema < 1, "ema", "in [0, 1)", self.ema)
        require(
            self.cap_bytes_per_step is None or self.cap_bytes_per_step >= 1,
            "cap_bytes_per_step",
            "None or >= 1",
            self.cap_bytes_per_step,
        )


class DrainBudget:
    """Per-writer bandwidth estimates and the budget they give (``None`` until every writer
    has written something and a step time is known)."""

    def __init__(self, config: WriteBudgetConfig, writers: int) -> None:
        self.config = config
        self._totals = [(0.0, 0.0)] * writers
        self._rate: list[float | None] = [None] * writers
        self.budget: int | None = None

    @property
    def bandwidth(self) -> float | None:
        """Bytes per second all writers drain together (``None`` until each has a measurement)."""
        if any(r is None for r in self._rate):
            return None
        return float(sum(r for r in self._rate if r is not None))

    def update(self, *, written_bytes: Sequence[float], write_s: Sequence[float], step_s: float) -> int | None:
        """Take every writer's running totals and the step time; the budget in bytes per step."""
        if len(written_bytes) != len(self._totals) or len(write_s) != len(self._totals):
            raise ValueError(f"expected totals of {len(self._totals)} writers, got {len(written_bytes)}/{len(write_s)}")
        beta = self.config.ema
        for i, (nbytes, seconds) in enumerate(zip(written_bytes, write_s)):
            old_bytes, old_s = self._totals[i]
            if seconds > old_s and nbytes > old_bytes:
                sample = (nbytes - old_bytes) / (seconds - old_s)
                previous = self._rate[i]
                self._rate[i] = sample if previous is None else beta * previous + (1 - beta) * sample
            self._totals[i] = (float(nbytes), float(seconds))
        bandwidth = self.bandwidth
        if bandwidth is None or step_s <= 0:
            return self.budget
        budget = max(1, int(self.config.headroom * bandwidth * step_s))
        if self.config.cap_bytes_per_step is not None:
            budget = min(budget, self.config.cap_bytes_per_step)
        if self.budget is None:
            logger.info(
                "write budget: %d bytes/step (drain %.3g B/s x step %.3gs x headroom %g%s)",
                budget,
                bandwidth,
                step_s,
                self.config.headroom,
                f", cap {self.config.cap_bytes_per_step}" if self.config.cap_bytes_per_step else "",
            )
        self.budget = budget
        return budget
