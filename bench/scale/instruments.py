"""What the harness measures on the rank side, without changing the product: actor handles that
count each call a rank makes (:class:`CountingHandle`), and the product's Ray coordinator with the
time each measured step's decision took to come back (:class:`TimedCoordinator`)."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from layercheck.orchestrator.runtime.ray_coordinator import RayCoordinator, Sent


class CallCounts:
    """Calls by ``actor.method``, from any thread."""

    def __init__(self) -> None:
        self._counts: Counter[str] = Counter()
        self._lock = threading.Lock()

    def add(self, key: str) -> None:
        with self._lock:
            self._counts[key] += 1

    def take(self) -> dict[str, int]:
        """The counts so far, and start again from zero."""
        with self._lock:
            counts, self._counts = dict(self._counts), Counter()
        return counts


class _CountingMethod:
    def __init__(self, method: Any, counts: CallCounts, key: str) -> None:
        self._method, self._counts, self._key = method, counts, key

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        self._counts.add(self._key)
        return self._method.remote(*args, **kwargs)

    def options(self, **options: Any) -> _CountingMethod:
        return _CountingMethod(self._method.options(**options), self._counts, self._key)


class CountingHandle:
    """An actor handle whose ``method.remote(...)`` calls are counted as ``{name}.{method}``;
    pickled (handed to another actor), it is the plain handle."""

    def __init__(self, handle: Any, name: str, counts: CallCounts) -> None:
        self._handle, self._name, self._counts = handle, name, counts

    def __getattr__(self, method: str) -> _CountingMethod:
        return _CountingMethod(getattr(self._handle, method), self._counts, f"{self._name}.{method}")

    def __reduce__(self) -> tuple[Callable[[Any], Any], tuple[Any]]:
        return (_plain, (self._handle,))

    def __eq__(self, other: object) -> bool:
        return (other._handle if isinstance(other, CountingHandle) else other) == self._handle

    def __hash__(self) -> int:
        return hash(self._handle)


def _plain(handle: Any) -> Any:
    return handle


class TimedCoordinator(RayCoordinator):
    """The product's coordinator; each measured step's report is timed from the moment it leaves to
    the moment its answer (the step's decision, with the quiet steps' plan) is back on this rank."""

    def __init__(self, *, latencies: list[float], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._latencies = latencies

    def _send_report(
        self, step: int, rank: int, lr: float, l1: dict[str, float], counts: dict[str, int], measured: bool
    ) -> Sent:
        sent = time.monotonic()
        answer = super()._send_report(step, rank, lr, l1, counts, measured)
        if isinstance(answer, Future):
            answer.add_done_callback(lambda _: self._latencies.append(time.monotonic() - sent))
        return answer
