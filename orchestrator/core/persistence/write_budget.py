"""The write budget a schedule plans under: bytes per step the writers can drain.

Every report round carries each writer's running totals (bytes written, seconds spent writing)
and the step time; :class:`DrainBudget` turns them into ``budget = headroom × drain bandwidth ×
step time`` (capped), which the policy service puts on the step's
:class:`~layercheck.policies.decision.StepObservation` as ``write_budget_bytes``. A budget-aware schedule
(``staggered``) stretches its periods when storage is slower than its plan, so the queue of
snapshots cannot grow without bound; policies without a budget ignore it.

The bandwidth is the sum over writers (they write in parallel) of each one's EMA of
``Δbytes / Δwrite-seconds`` between reports, keyed by writer id: under Ray writers live per node
and a dead one is replaced under a new id (:meth:`DrainBudget.forget` drops the old one's rate).
Pure and deterministic in its inputs: the local runtime feeds every rank's replica the same
gathered totals, so every replica decides alike; the Ray policy actor is fed by the writers
(fire-and-forget, off the ranks' critical path) and times the steps itself (:class:`StepClock`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

from layercheck.policies.config_loader import require, require_finite

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class WriteBudgetConfig:
    """How the writers' measured drain bandwidth becomes the schedule's byte budget per step."""

    enabled: bool = True
    """Measure the writers' drain bandwidth and give the schedule a budget from it (a budget-aware
    schedule such as ``staggered`` stretches its periods when storage is slower than its plan)."""
    headroom: float = 0.8
    """Fraction of the measured drain bandwidth the schedule may plan to use (the rest absorbs
    bursts and slow writes), in (0, 1]."""
    ema: float = 0.8
    """Smoothing of each writer's bandwidth (and of the step time) per new measurement
    (exponential moving average), in [0, 1)."""
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
    """Per-writer bandwidth estimates, keyed by writer id, and the budget they give (``None``
    until some writer is known, every known writer has written something, and a step time is
    known)."""

    def __init__(self, config: WriteBudgetConfig) -> None:
        self.config = config
        self._totals: dict[str, tuple[float, float]] = {}
        self._rate: dict[str, float | None] = {}
        self._gone: set[str] = set()
        self.budget: int | None = None

    @property
    def writers(self) -> tuple[str, ...]:
        return tuple(self._totals)

    @property
    def bandwidth(self) -> float | None:
        """Bytes per second all writers drain together (``None`` until each has a measurement)."""
        if not self._rate or any(r is None for r in self._rate.values()):
            return None
        return float(sum(r for r in self._rate.values() if r is not None))

    def observe(self, writer: str, *, written_bytes: float, write_s: float) -> None:
        """One writer's running totals. Totals that went down are a new writer under the same id
        (the local runtime replaces a rank's writer in place): they become the new baseline."""
        if writer in self._gone:
            return  # a late report of a replaced writer
        old_bytes, old_s = self._totals.get(writer, (0.0, 0.0))
        self._rate.setdefault(writer, None)
        if write_s > old_s and written_bytes > old_bytes:
            sample = (written_bytes - old_bytes) / (write_s - old_s)
            previous, beta = self._rate[writer], self.config.ema
            self._rate[writer] = sample if previous is None else beta * previous + (1 - beta) * sample
        self._totals[writer] = (float(written_bytes), float(write_s))

    def forget(self, writer: str) -> None:
        """``writer`` was replaced: its rate no longer counts, and its late reports are ignored."""
        self._gone.add(writer)
        self._totals.pop(writer, None)
        self._rate.pop(writer, None)

    def budget_for(self, step_s: float | None) -> int | None:
        """``headroom × bandwidth × step_s``, capped; the last budget while one is unknown."""
        bandwidth = self.bandwidth
        if bandwidth is None or step_s is None or step_s <= 0:
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

    def update(self, totals: Mapping[str, tuple[float, float]], *, step_s: float) -> int | None:
        """Every writer's running totals (``{id: (bytes written, write seconds)}``) and the step
        time: the budget in bytes per step."""
        for writer, (nbytes, seconds) in totals.items():
            self.observe(writer, written_bytes=nbytes, write_s=seconds)
        return self.budget_for(step_s)


class StepClock:
    """The step time a policy host observes: an EMA of the intervals between consecutive
    completed steps (times passed in, so it is deterministic under test)."""

    def __init__(self, ema: float) -> None:
        self.ema = ema
        self.step_s: float | None = None
        self._last: tuple[int, float] | None = None

    def completed(self, step: int, now: float) -> float | None:
        """Step ``step`` completed at ``now``; the smoothed step time so far."""
        last = self._last
        self._last = (step, now)
        if last is not None and step > last[0] and now > last[1]:
            sample = (now - last[1]) / (step - last[0])
            self.step_s = sample if self.step_s is None else self.ema * self.step_s + (1 - self.ema) * sample
        return self.step_s

    def reset(self) -> None:
        """A new worker group: the gap across a recovery is no step time."""
        self._last = None
