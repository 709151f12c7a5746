"""The Ray a micro-benchmark runs its actors on: the one this process is connected to (a test's),
or a local one started for the measurement and shut down after it."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import ray


@contextlib.contextmanager
def local_ray(num_cpus: int = 2) -> Iterator[None]:
    """Connected to Ray inside the block; a Ray started here is shut down when it ends."""
    if ray.is_initialized():
        yield
        return
    ray.init(num_cpus=num_cpus, include_dashboard=False, logging_level=logging.ERROR)
    try:
        yield
    finally:
        ray.shutdown()
