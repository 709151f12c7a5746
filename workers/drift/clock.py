"""What the drift probe costs: the time of its own work, measured without waiting for a device.

A probe's work is a few spans inside the step (the reference copy and the diff of
snapshot-and-diff, the copies and norms beside DriftAdamW's foreach update, the whole fused
update). On CPU a span is timed by the wall clock, since the work runs as it is issued. On a GPU
the host only queues the work, so a span is a pair of CUDA events on the current stream, read
once the device has passed the second one: the device's time from one to the other (a wait for
the host to issue the span's work counts too), never an extra sync.

A probe reports what it timed as a :class:`~layercheck.workers.progress.ProbeCost`. A probe that
runs the whole update in place of the optimizer's own step also times that step, on the unmeasured
step after each such one (:class:`OwnStep`): what its measured step is read against.
"""

from __future__ import annotations

import time
from collections import deque
from types import TracebackType

import torch

#: GPU spans kept before the finished ones are counted even if nobody takes the time.
PENDING_SPANS = 1024


class ProbeClock:
    """Sums the time of the spans a probe opens with :meth:`span`; :meth:`take` hands it over."""

    def __init__(self) -> None:
        self._seconds = 0.0
        self._pending: deque[tuple[torch.cuda.Event, torch.cuda.Event]] = deque()

    def span(self, device: torch.device) -> Span:
        """``with clock.span(device):`` around work issued for ``device`` (or :meth:`Span.start` and
        :meth:`Span.stop` where the work begins and ends in different calls)."""
        return Span(self, device if device.type == "cuda" else None)

    def take(self) -> float:
        """The seconds of the spans finished since the last call (on a GPU, those the device has
        passed; the others are counted by a later call)."""
        self._drain()
        seconds, self._seconds = self._seconds, 0.0
        return seconds

    def _closed(self, start: torch.cuda.Event, end: torch.cuda.Event) -> None:
        self._pending.append((start, end))
        if len(self._pending) > PENDING_SPANS:  # nobody takes the time (DriftAdamW on its own)
            self._drain()

    def _drain(self) -> None:
        """Count the GPU spans the device has passed, and let their events go."""
        while self._pending and self._pending[0][1].query():
            start, end = self._pending.popleft()
            self._seconds += start.elapsed_time(end) / 1e3


class OwnStep:
    """The optimizer's own step, timed on the step after each step whose update a probe ran in
    its place (the fused step): what that step stands in for. The probe says when it replaced a
    step (:meth:`replaced`), opens :meth:`span` around the optimizer's step (a span only where one
    is due) and :meth:`settle` s once per training step."""

    def __init__(self) -> None:
        self.clock = ProbeClock()
        self._due = False  # the next step is timed
        self._timed = False
        self._replaced = False

    def replaced(self) -> None:
        """The probe ran the update in place of the optimizer's step."""
        self._replaced = True

    def span(self, device: torch.device) -> Span | None:
        """A span around the optimizer's own step where this step is timed, else ``None``."""
        if not self._due:
            return None
        self._timed = True
        return self.clock.span(device)

    def settle(self, *, measured: bool, next_measured: bool) -> tuple[bool, float, int]:
        """At the end of a training step: whether it was a measured step the probe replaced, the own
        steps' seconds finished since the last call and how many steps were timed (0 or 1); the
        next step is timed if this one was replaced and the next is not measured."""
        replaced, timed = self._replaced and measured, self._timed
        self._replaced = self._timed = False
        self._due = replaced and not next_measured
        return replaced, self.clock.take(), int(timed)

    def reset(self) -> None:
        """A restore or a seek: nothing is due (the step before is not the one just timed)."""
        self._due = self._replaced = False


class Span:
    __slots__ = ("_clock", "_cuda", "_start")

    def __init__(self, clock: ProbeClock, cuda: torch.device | None) -> None:
        self._clock = clock
        self._cuda = cuda
        self._start: float | torch.cuda.Event = 0.0

    def __enter__(self) -> None:
        self.start()

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.stop()

    def start(self) -> None:
        if self._cuda is None:
            self._start = time.perf_counter()
            return
        self._start = torch.cuda.Event(enable_timing=True)
        self._start.record(torch.cuda.current_stream(self._cuda))

    def stop(self) -> None:
        """The span ends: its time goes to its clock."""
        start = self._start
        if isinstance(start, float):
            self._clock._seconds += time.perf_counter() - start
            return
        end = torch.cuda.Event(enable_timing=True)
        end.record(torch.cuda.current_stream(self._cuda))
        self._clock._closed(start, end)
