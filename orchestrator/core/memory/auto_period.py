"""``persistence.memory_period = "auto"`` (the default): the period of the memory versions, chosen
at a run's start from the writers' host memory and from what the copy measurably costs, so that a
default run's lost slices come back at most that many steps stale for about 1% of its step time.

1. **At the start** (:func:`starting_period`), from the layer sizes alone: a writer's
   ``memory_bytes`` must hold a whole memory version of the ranks it serves
   (:mod:`~layercheck.orchestrator.core.memory.budget`); where it cannot, memory versions are off,
   and the run says so. Else every step (P = 1), tentatively: the copy's cost is only known by
   making it, and the first steps of a fine-tune move fastest, so a failure among them is the one
   that costs most when the lost slices come back stale (issue 60: 14% off the failure-free
   losses after a failure at step 8 of a 135M-parameter SFT, with no memory versions).
2. **From the first steps' own timings** (:class:`PeriodTimer`): rank 0 times each memory version's
   copy and hand-over (``StepProgress.memory_s``) and its step (``compute_s``). The first copy is
   not counted (it allocates the host buffers the later ones reuse); of the next
   :data:`TIMED_COPIES`, the medians choose P (:func:`choose_period`): the smallest period at which
   one copy every P steps costs at most :data:`COST_SHARE` of the step time.
3. The supervisor hands P to the policy, whose decisions carry it to every rank, so all ranks
   switch at the same step (``PersistDecision.memory_period``).

Explicit settings are kept as they are: ``0`` off, ``N`` every N steps. Pure arithmetic over
numbers the runtime measured; no Ray, no clock.
"""

from __future__ import annotations

import logging
import math
import statistics
from dataclasses import dataclass, replace
from typing import Any, Final, Literal

from layercheck.orchestrator.core.memory.budget import MemoryVersionNeed
from layercheck.orchestrator.table import human_bytes

logger = logging.getLogger(__name__)

AUTO: Final = "auto"
#: ``persistence.memory_period``: steps between memory versions (0: off), or ``"auto"``.
MemoryPeriodSetting = int | Literal["auto"]
#: The most a memory version may cost a rank, as a share of its step time averaged over its period.
COST_SHARE = 0.01
#: Copies timed (after the first) before the period is chosen: their median, so one slow copy
#: (a page fault storm, a busy neighbour) does not set the run's period.
TIMED_COPIES = 3
#: Past this period memory versions are off: a version rarer than the default schedule's mean save
#: period (``StaggeredConfig.period`` = 100 steps) is no fresher than the stored versions beside it.
MAX_PERIOD = 100


@dataclass(frozen=True, kw_only=True)
class MemoryPeriod:
    """The memory versions' period a run uses, and why (the summary's ``memory versions`` row)."""

    period: int
    """Steps between memory versions in force now (0: none)."""
    why: str
    auto: bool = False
    """Chosen by the run (``persistence.memory_period = "auto"``), not set by the user."""
    start: int = 0
    """The period in force until it was chosen (auto: 1 tentatively, or 0 where off from the start)."""
    chosen_at: int | None = None
    """Auto: the step whose timings chose ``period`` (``None``: not chosen yet, ``start`` in force)."""

    def at(self, step: int) -> int:
        """The period in force at ``step``. Once chosen, the ranks switch a few steps later (with
        the decision that carries it), so ``period`` is claimed only past ``chosen_at``; where the
        switch is from 1 to a longer period, the bound still holds across it."""
        if not self.auto or (self.chosen_at is not None and step > self.chosen_at):
            return self.period
        return self.start

    def to_json(self) -> dict[str, object]:
        return {
            "period": self.period,
            "why": self.why,
            "auto": self.auto,
            "start": self.start,
            "chosen_at": self.chosen_at,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> MemoryPeriod:
        return cls(
            period=int(data["period"]),
            why=str(data["why"]),
            auto=bool(data.get("auto", False)),
            start=int(data.get("start", 0)),
            chosen_at=data.get("chosen_at"),
        )


def _room(need: MemoryVersionNeed, memory_bytes: int) -> str:
    return f"{human_bytes(need.nbytes)} of {human_bytes(memory_bytes)} per writer"


def starting_period(setting: MemoryPeriodSetting, *, need: MemoryVersionNeed, memory_bytes: int) -> MemoryPeriod:
    """The period a run starts with: an explicit ``setting`` as it is; ``"auto"``: off where a
    writer's ``memory_bytes`` cannot hold a whole memory version (``need``: of the ranks one writer
    holds, :func:`~layercheck.orchestrator.core.memory.budget.memory_version_need`), else 1 until
    the copies are timed."""
    if setting != AUTO:
        period = int(setting)
        why = f"every {period} step{'s' if period != 1 else ''}" if period else "off"
        return MemoryPeriod(period=period, start=period, why=f"{why} (persistence.memory_period = {period})")
    if not memory_bytes:
        return MemoryPeriod(period=0, auto=True, why="auto: off (persistence.memory_bytes = 0: no memory tier)")
    if need.nbytes > memory_bytes:
        return MemoryPeriod(
            period=0,
            auto=True,
            why=(
                f"auto: off (a memory version of the {need.ranks} rank(s) of {need.world_size} one writer holds is "
                f"{human_bytes(need.nbytes)}, beyond persistence.memory_bytes = {human_bytes(memory_bytes)}; "
                f"memory_bytes >= {need.nbytes} would hold it)"
            ),
        )
    return MemoryPeriod(
        period=1,
        start=1,
        auto=True,
        why=f"auto: 1 until rank 0's first copies are timed ({_room(need, memory_bytes)})",
    )


def choose_period(*, step_s: float, copy_s: float, need: MemoryVersionNeed, memory_bytes: int) -> MemoryPeriod:
    """The smallest period at which one memory version every P steps costs a rank at most
    :data:`COST_SHARE` of its step time (``copy_s``: one memory version's copy and hand-over;
    ``step_s``: the step without LayerCheck's work); off past :data:`MAX_PERIOD`. ``chosen_at``
    is for the caller to set."""
    if step_s <= 0:
        raise ValueError(f"step_s must be > 0, got {step_s}")
    share = max(copy_s, 0.0) / step_s
    # (rounded first: a copy of exactly 1% must not come out as period 2 by a float's last bit)
    period = max(1, math.ceil(round(share / COST_SHARE, 9)))
    copy = f"copy {_ms(copy_s)} = {share:.1%} of a {_ms(step_s)} step"
    room = _room(need, memory_bytes)
    if period > MAX_PERIOD:
        return MemoryPeriod(
            period=0,
            auto=True,
            start=1,
            why=(
                f"auto: off ({copy}: within {COST_SHARE:.0%} only every {period} steps, rarer than every "
                f"{MAX_PERIOD}; {room})"
            ),
        )
    spread = "" if period == 1 else f", {share / period:.2%} a step every {period}"
    return MemoryPeriod(period=period, auto=True, start=1, why=f"auto: {period} ({copy}{spread}; {room})")


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms" if seconds < 10 else f"{seconds:.1f} s"


class PeriodTimer:
    """The supervisor's side of ``"auto"``: rank 0's timings of its first memory versions, into
    the period (see the module). Not thread-safe: its owner holds its lock."""

    def __init__(self, start: MemoryPeriod, *, need: MemoryVersionNeed, memory_bytes: int) -> None:
        self.current = start
        self.need = need
        self.memory_bytes = memory_bytes
        self._copies: list[float] = []
        self._steps: list[float] = []
        self._skip = 1  # copies still to pass over: the first after a (re)start allocates the buffers

    @property
    def timing(self) -> bool:
        """Still timing copies: auto, memory versions on, no period chosen yet."""
        current = self.current
        return current.auto and current.period > 0 and current.chosen_at is None

    def observe(self, *, step: int, compute_s: float, memory_s: float) -> MemoryPeriod | None:
        """Rank 0's step ``step``: its step time and what its memory version took (0: none taken
        at it). Returns the period once it is chosen (once), else ``None``."""
        if not self.timing or memory_s <= 0 or compute_s <= 0:
            return None
        if self._skip:
            self._skip -= 1
            return None
        self._copies.append(memory_s)
        self._steps.append(compute_s)
        if len(self._copies) < TIMED_COPIES:
            return None
        chosen = choose_period(
            step_s=statistics.median(self._steps),
            copy_s=statistics.median(self._copies),
            need=self.need,
            memory_bytes=self.memory_bytes,
        )
        self.current = replace(chosen, chosen_at=step)
        logger.info("persistence.memory_period %s, from steps up to %d", self.current.why, step)
        return self.current

    def group_started(self) -> None:
        """A new worker group: its first copy allocates its buffers anew, so it is not timed."""
        self._skip = 1
