"""Run a function on N local ranks from a test: ``run_ranks(fn, world_size, *args)`` is
:func:`layercheck.orchestrator.local.spawn.spawn_ranks` (``fn(rank, world_size, *args)`` in each process,
results in rank order; a failing or hung rank raises here, naming it)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from layercheck.orchestrator.local.spawn import spawn_ranks


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 300.0) -> list[Any]:
    return spawn_ranks(fn, world_size, *args, timeout_s=timeout_s, what=getattr(fn, "__name__", "ranks"))
