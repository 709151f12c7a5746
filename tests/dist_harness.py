"""Run a function on N local ranks (torch.multiprocessing + gloo) from a test.

``run_ranks(fn, world_size, *args)`` starts ``world_size`` processes with the rendezvous
variables torch.distributed reads, calls ``fn(rank, world_size, *args)`` in each, and returns
their results in rank order. ``fn`` must be importable (a module-level function) and return
something JSON-serialisable; a failure in any rank raises here with that rank's traceback.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from workers.env import free_port
from workers.spawn import exit_without_teardown


def _entry(rank: int, fn: Callable[..., Any], world_size: int, port: int, out_dir: str, args: tuple[Any, ...]) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    try:
        result = fn(rank, world_size, *args)
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    exit_without_teardown()  # the result is on disk; a teardown abort must not fail the rank


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 300.0) -> list[Any]:
    """``[fn(0, world_size, *args), …, fn(world_size - 1, …)]``, each run in its own process."""
    with tempfile.TemporaryDirectory(prefix="layercheck-ranks-") as out_dir:
        context = mp.start_processes(_entry, args=(fn, world_size, free_port(), out_dir, args),
                                     nprocs=world_size, join=False, start_method="spawn")
        try:
            while not context.join(timeout=timeout_s):
                pass
        except BaseException:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
            raise
        return [json.loads(Path(out_dir, f"rank{r}.json").read_text()) for r in range(world_size)]
