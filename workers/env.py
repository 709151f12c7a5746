"""The process environment DeepSpeed needs, set explicitly by us rather than by the user.

On a host without CUDA, DeepSpeed must use its CPU accelerator (``DS_ACCELERATOR=cpu``) and
the gloo backend; a lone process also needs the rendezvous variables torch.distributed reads.
Under Ray Train or torchrun these are already set and are left alone. Nothing runs at import.
"""

from __future__ import annotations

import glob
import logging
import os
import socket
import time
from datetime import timedelta

import torch

logger = logging.getLogger(__name__)


def comm_backend() -> str:
    """``nccl`` where CUDA is available, ``gloo`` otherwise."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def free_port() -> int:
    """A TCP port that was free a moment ago on this host (for a local rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def set_accelerator() -> None:
    """DeepSpeed's accelerator, before the first ``import deepspeed`` in the process: CPU (gloo)
    where there is no CUDA device, unless ``DS_ACCELERATOR`` says otherwise."""
    if not torch.cuda.is_available() and "DS_ACCELERATOR" not in os.environ:
        os.environ["DS_ACCELERATOR"] = "cpu"
        logger.info("no CUDA device: DS_ACCELERATOR=cpu (gloo backend)")


def prepare_environment() -> None:
    """Set DeepSpeed's accelerator and, for a lone process, a one-rank rendezvous.

    Call before the first ``import deepspeed`` in the process: DeepSpeed resolves its
    accelerator once and caches it.
    """
    set_accelerator()
    if not torch.distributed.is_initialized() and "WORLD_SIZE" not in os.environ:
        port = free_port()
        for key, value in (
            ("RANK", "0"),
            ("LOCAL_RANK", "0"),
            ("WORLD_SIZE", "1"),
            ("MASTER_ADDR", "127.0.0.1"),
            ("MASTER_PORT", str(port)),
        ):
            os.environ.setdefault(key, value)
        logger.info("no distributed environment: running as a single rank (port %d)", port)


#: A JIT build of DeepSpeed's shm op takes 30-40 s; a lock this old with no build running is a
#: killed build's leftover, on which every later start would wait forever.
STALE_LOCK_S = 600.0


def extension_locks(root: str | None = None) -> list[str]:
    """The lock files of DeepSpeed's JIT-built ops in torch's extension cache."""
    root = root or os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.expanduser("~/.cache/torch_extensions")
    return sorted(
        glob.glob(os.path.join(root, "*", "deepspeed_*", "lock")) + glob.glob(os.path.join(root, "deepspeed_*", "lock"))
    )


def _builders(build_dir: str) -> list[int]:
    """Pids of live processes working in ``build_dir`` (ninja, the compiler); Linux /proc only."""
    pids = []
    for entry in glob.glob("/proc/[0-9]*/cwd"):
        try:
            if os.path.realpath(entry).startswith(os.path.realpath(build_dir)):
                pids.append(int(entry.split("/")[2]))
        except OSError:
            continue  # gone, or not ours to look at
    return pids


def check_build_locks(root: str | None = None, *, now: float | None = None, stale_s: float = STALE_LOCK_S) -> None:
    """Name a DeepSpeed JIT build lock that would hang this process: raise for one older than
    ``stale_s`` with no live process building in its directory (a killed build's leftover); log
    one that may belong to a build in progress elsewhere."""
    now = time.time() if now is None else now
    for lock in extension_locks(root):
        try:
            age = now - os.stat(lock).st_mtime
        except FileNotFoundError:
            continue  # the build just finished
        if age >= stale_s and not _builders(os.path.dirname(lock)):
            raise RuntimeError(
                f"stale DeepSpeed build lock {lock} ({age / 60:.0f} min old, no build running): a build was "
                f"killed while it held it, and every start would wait on it forever. Delete it: rm {lock}"
            )
        logger.warning(
            "DeepSpeed's JIT build lock %s exists (%.0f s old): waiting for that build; if none is "
            "running (a killed build leaves it), delete the file",
            lock,
            age,
        )


def serve_store(host: str, world_size: int, timeout_s: float) -> torch.distributed.TCPStore:
    """A rendezvous store for a group of ``world_size``, served by this process on a port the OS
    picks (its ``port``); the other ranks reach it at ``host`` (:func:`reach_store`). Returns at once."""
    return torch.distributed.TCPStore(
        host, 0, world_size, is_master=True, timeout=timedelta(seconds=timeout_s), wait_for_workers=False
    )


def reach_store(host: str, port: int, world_size: int, timeout_s: float) -> torch.distributed.TCPStore:
    """The store another rank serves at ``host:port`` (:func:`serve_store`)."""
    return torch.distributed.TCPStore(host, port, world_size, is_master=False, timeout=timedelta(seconds=timeout_s))


def init_distributed(store: torch.distributed.Store | None = None, *, engine: str = "deepspeed") -> None:
    """Join (or create) the default process group the engine will use: through ``store`` if given
    (with ``RANK`` and ``WORLD_SIZE`` from the environment; every rank of the group passes one,
    :func:`serve_store`, :func:`reach_store`), else ``env://``. ``engine="deepspeed"`` (also for a
    user's loop, whose engine is not known yet) also starts DeepSpeed's communication backend over
    it (:func:`layercheck.workers.engines.deepspeed.join_group`); ``"fsdp2"``: torch's group only."""
    prepare_environment()
    if engine == "deepspeed":
        from layercheck.workers.engines.deepspeed import join_group

        join_group(store)
        return
    form_group(store)


def form_group(store: torch.distributed.Store | None) -> None:
    """torch's default group through ``store`` (``RANK``/``WORLD_SIZE`` from the environment), or
    ``env://``; nothing if one is formed already (by Ray Train)."""
    if torch.distributed.is_initialized():
        return
    if store is not None:
        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        torch.distributed.init_process_group(backend=comm_backend(), store=store, rank=rank, world_size=world_size)
    else:
        torch.distributed.init_process_group(backend=comm_backend(), init_method="env://")
