"""Timing helpers the micro-benchmarks share: host wall time around a call, the device
synchronised on both sides so that queued kernels are counted."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def sync(device: str) -> None:
    """Wait for the device's queued work (a no-op on CPU)."""
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def timed(fn: Callable[[], None], device: str) -> float:
    """Seconds one call of ``fn`` takes, the device idle before and synchronised after."""
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


def issue_seconds(fn: Callable[[], None], device: str, steps: int) -> float:
    """Median host seconds until ``fn`` returns, the device idle before each call: how long the
    CPU takes to issue the work (a step whose issue time is its whole time is CPU-bound)."""
    samples = []
    for _ in range(steps):
        sync(device)
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    sync(device)
    return statistics.median(samples)


def time_interleaved(fns: dict[str, Callable[[], None]], device: str, steps: int, warmup: int = 3) -> dict[str, float]:
    """Median seconds per call of each function, run in turn so that load drifts hit all alike."""
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for i in range(warmup + steps):
        for name, fn in fns.items():
            seconds = timed(fn, device)
            if i >= warmup:
                samples[name].append(seconds)
    return {name: statistics.median(values) for name, values in samples.items()}
