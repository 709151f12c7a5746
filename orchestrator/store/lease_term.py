"""Until when this process may write to a run's store: the run's lease as its driver last wrote it.

The lease (``lease.py``) keeps a second run out only while it is renewed. Once its expiry has
passed, another run may take the store over (``--resume`` finds it expired), and a write or a
commit this run makes after that point races it: the epochs fence the late *commits* out, but
only at the check before each commit, and the files themselves still land. A driver whose
renewals do not reach the store (storage that accepts connections and never answers, a frozen
driver) cannot tell its writers anything, so each process that writes or commits holds a
:class:`LeaseTerm`: the wall-clock time the lease is valid until, as the driver's last
*successful* renewal wrote it, pushed to it after each renewal. Once that time has passed the term
is over for good: the store refuses every write and commit (:class:`LeaseLapsedError`, which the
writers count as failed writes) and the run stops. A renewal that lands before the expiry only
moves it on.

Wall clocks of different hosts are compared, as the lease's own expiry is (``stale_reason``):
the lease's TTL (minutes) dwarfs their skew under NTP (milliseconds).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from layercheck.orchestrator.store.errors import LeaseLapsedError

logger = logging.getLogger(__name__)

#: How a run stopped for a lapsed lease says so (its stop reason starts with this).
LEASE_LAPSED = "the store's lease lapsed"


def _clock(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


class LeaseTerm:
    """The run's lease, as far as this process knows: valid until :attr:`valid_until` (wall clock).
    Thread-safe: renewals arrive on one thread, writes and commits check on others."""

    def __init__(self, *, uri: str, valid_until: float, clock: Callable[[], float] = time.time) -> None:
        self.uri = uri
        self._valid_until = valid_until
        self._clock = clock
        self._lock = threading.Lock()
        self._lapsed = ""

    @property
    def valid_until(self) -> float:
        with self._lock:
            return self._valid_until

    def renewed(self, valid_until: float) -> None:
        """The driver's renewal wrote ``valid_until`` to the store. Renewals may arrive out of order
        (the later expiry wins); one that arrives after the term ended does not revive it: the
        store was another run's to take meanwhile."""
        if self.lapsed():
            logger.warning(
                "a renewal of the lease on %s (valid until %s) came after it lapsed: too late, this run "
                "writes nothing more",
                self.uri,
                _clock(valid_until),
            )
            return
        with self._lock:
            self._valid_until = max(self._valid_until, valid_until)

    def lapsed(self) -> str:
        """Why this run may write nothing more to the store ("" while the lease is valid). Once
        said, said for good."""
        with self._lock:
            if not self._lapsed and self._clock() >= self._valid_until:
                self._lapsed = (
                    f"the lease on {self.uri} lapsed at {_clock(self._valid_until)} (no renewal reached the "
                    "store in time; another run may take it over): this run writes and commits nothing more"
                )
                logger.error("%s", self._lapsed)
            return self._lapsed

    def check(self) -> None:
        """Raise :class:`LeaseLapsedError` once the lease has lapsed."""
        reason = self.lapsed()
        if reason:
            raise LeaseLapsedError(reason)
