"""Run functions on N local ranks from a test.

``run_ranks(fn, world_size, *args)`` is :func:`layercheck.orchestrator.local.spawn.spawn_ranks`
(``fn(rank, world_size, *args)`` in each process, results in rank order; a failing or hung rank
raises here, naming it).

``run_jobs(world_size, [(fn, args), ...])`` runs several such jobs one after the other in the same
spawned processes: a Python start and the torch/DeepSpeed/transformers imports (about 5 s a rank)
are paid once, not once per job. The jobs share the default process group (DeepSpeed keeps its
groups in module globals: a new default group would leave them stale), so a job's own
``destroy_process_group()`` of the default group waits until the last job is done. Results:
``[[job 0's rank 0, rank 1, ...], [job 1's ...], ...]``. A failing job fails them all, naming it."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from layercheck.orchestrator.local.spawn import spawn_ranks

Job = tuple[Callable[..., Any], tuple[Any, ...]]


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 300.0) -> list[Any]:
    return spawn_ranks(fn, world_size, *args, timeout_s=timeout_s, what=getattr(fn, "__name__", "ranks"))


def run_jobs(world_size: int, jobs: Sequence[Job], *, timeout_s: float = 600.0) -> list[list[Any]]:
    names = ", ".join(sorted({fn.__name__ for fn, _ in jobs}))
    per_rank = spawn_ranks(_in_turn, world_size, list(jobs), timeout_s=timeout_s, what=f"jobs ({names})")
    return [[per_rank[rank][i] for rank in range(world_size)] for i in range(len(jobs))]


def _in_turn(rank: int, world_size: int, jobs: Sequence[Job]) -> list[Any]:
    destroy = torch.distributed.destroy_process_group

    def keep_default(group: Any = None) -> None:
        if group is not None:
            destroy(group)

    torch.distributed.destroy_process_group = keep_default
    try:
        results = []
        for i, (fn, args) in enumerate(jobs):
            try:
                results.append(fn(rank, world_size, *args))
            except Exception as error:
                raise RuntimeError(
                    f"job {i}, {fn.__name__}{tuple(args)!r}, failed on rank {rank}: {error!r}"
                ) from error
        return results
    finally:
        torch.distributed.destroy_process_group = destroy
