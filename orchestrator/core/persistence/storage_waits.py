"""The training thread's waits for storage: past ``persistence.max_inflight_bytes`` of snapshots
handed over and not yet written, a rank waits for writes before it goes on (both runtimes: the
in-process writer's ``submit``, the Ray coordinator's bound).

A run whose storage is slower than its schedule waits at every save, several times a second on a
large model, so the warning is rate-limited: the first wait says what is happening and how to
change it; later ones say, at most once every ``every_s``, how often and how long the rank waited
since. ``blocked_s`` (every wait, whether logged or not) is what the metrics and the summary
count as stall."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)

#: Seconds between two warnings of the same rank about its waits.
WARN_EVERY_S = 60.0


class StorageWaits:
    """A writer's (one rank's) waits for storage, timed and logged."""

    def __init__(self, *, every_s: float = WARN_EVERY_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.every_s = every_s
        self._clock = clock
        self.blocked_s = 0.0
        """Seconds spent waiting, over every wait."""
        self.waits = 0
        self._warned_at: float | None = None
        self._since_warned = (0, 0.0)  # waits and seconds not yet reported

    def begin(self, rank: int, inflight_bytes: int, bound: int) -> float:
        """Rank ``rank`` starts to wait, ``inflight_bytes`` in flight past its ``bound``: logged if
        its turn has come; the time it started."""
        now = self._clock()
        if self._warned_at is None:
            self._warned_at = now
            logger.warning(
                "rank %d: %d snapshot bytes in flight > %d: waiting for storage (it writes slower than the "
                "schedule hands over; a larger persistence.max_inflight_bytes absorbs bursts, and "
                "the staggered schedule's policy.spread_phases = true spreads its saves over the period; "
                "said again at most every %.0f s)",
                rank,
                inflight_bytes,
                bound,
                self.every_s,
            )
        elif now - self._warned_at >= self.every_s:
            waits, seconds = self._since_warned
            logger.warning(
                "rank %d: still waiting for storage: %d wait(s), %.1f s in all, over the last %.0f s "
                "(%d snapshot bytes in flight now > %d)",
                rank,
                waits,
                seconds,
                now - self._warned_at,
                inflight_bytes,
                bound,
            )
            self._warned_at, self._since_warned = now, (0, 0.0)
        return now

    def end(self, started: float) -> None:
        """The wait that began at ``started`` is over."""
        waited = self._clock() - started
        self.blocked_s += waited
        self.waits += 1
        waits, seconds = self._since_warned
        self._since_warned = (waits + 1, seconds + waited)
