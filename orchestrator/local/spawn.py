"""Run a function on N local ranks: one process each (torch.multiprocessing, spawn), with the
rendezvous variables torch.distributed reads. The benchmark, ``layercheck export`` and the tests
start their DeepSpeed ranks through :func:`spawn_ranks`.

A rank's result travels back as a JSON file (so ``fn`` returns something JSON-serialisable),
and the rank then ends without interpreter teardown (:func:`layercheck.workers.rank_exit.exit_without_teardown`).
A rank that raises, dies, or is still running at the deadline ends the whole group: its peers
would otherwise wait in a collective forever, so they are killed, and the error says which
rank failed (or which were still running) and why.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from layercheck.workers.env import free_port
from layercheck.workers.rank_exit import exit_without_teardown

logger = logging.getLogger(__name__)


class RanksFailedError(RuntimeError):
    """A spawned rank failed or the ranks ran past their deadline; says which and why."""

    def __init__(self, message: str, *, ranks: Sequence[int], detail: str = "") -> None:
        super().__init__(message)
        self.ranks = tuple(ranks)
        self.detail = detail
        """The failing rank's formatted traceback, where there is one."""


def _entry(
    rank: int, fn: Callable[..., object], world_size: int, port: int, out_dir: str, args: tuple[object, ...]
) -> None:
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    try:
        result = fn(rank, world_size, *args)
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    exit_without_teardown()  # the result is on disk; a teardown abort must not fail the rank


def spawn_ranks(
    fn: Callable[..., object], world_size: int, *args: object, timeout_s: float = 600.0, what: str = "local ranks"
) -> list[Any]:  # Any: each rank's result as JSON gives it back
    """``[fn(0, world_size, *args), …, fn(world_size - 1, …)]``, each in its own process.

    ``fn`` must be importable (a module-level function). Raises :class:`RanksFailedError` if a
    rank fails or the ranks have not all finished within ``timeout_s``; no rank outlives this call.
    """
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="layercheck-ranks-") as out_dir:
        context = mp.start_processes(
            _entry,
            args=(fn, world_size, free_port(), out_dir, tuple(args)),
            nprocs=world_size,
            join=False,
            start_method="spawn",
        )
        deadline = time.monotonic() + timeout_s
        try:
            while not context.join(timeout=max(0.05, min(5.0, deadline - time.monotonic()))):
                if time.monotonic() >= deadline:
                    running = [r for r, p in enumerate(context.processes) if p.is_alive()]
                    raise RanksFailedError(
                        f"{what}: rank(s) {running} of {world_size} still running after {timeout_s:.0f}s; killed",
                        ranks=running,
                    )
        except mp.ProcessRaisedException as error:
            logger.error("%s: rank %d failed:\n%s", what, error.error_index, error.msg)
            raise RanksFailedError(
                f"{what} failed on rank {error.error_index}: {_last_line(error.msg)}",
                ranks=[error.error_index],
                detail=error.msg,
            ) from None
        except mp.ProcessExitedException as error:
            raise RanksFailedError(f"{what}: {error}", ranks=[error.error_index]) from None
        finally:
            _kill_survivors(context.processes)
        return [json.loads(Path(out_dir, f"rank{r}.json").read_text()) for r in range(world_size)]


def _kill_survivors(processes: Sequence[Any]) -> None:
    """A failed rank leaves its peers waiting in a collective: end them."""
    for rank, process in enumerate(processes):
        if process.is_alive():
            logger.warning("killing rank %d (pid %d)", rank, process.pid)
            process.kill()
    for process in processes:
        process.join(timeout=10)


def _last_line(traceback_text: str) -> str:
    """The exception line that ends a formatted traceback."""
    lines = [line for line in traceback_text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else traceback_text
