"""The process environment DeepSpeed needs, set explicitly by us rather than by the user.

On a host without CUDA, DeepSpeed must use its CPU accelerator (``DS_ACCELERATOR=cpu``) and
the gloo backend; a lone process also needs the rendezvous variables torch.distributed reads.
Under Ray Train or torchrun these are already set and are left alone. Nothing runs at import.
"""

from __future__ import annotations

import logging
import os
import socket

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


def prepare_environment() -> None:
    """Set DeepSpeed's accelerator and, for a lone process, a one-rank rendezvous.

    Call before the first ``import deepspeed`` in the process: DeepSpeed resolves its
    accelerator once and caches it.
    """
    if not torch.cuda.is_available() and "DS_ACCELERATOR" not in os.environ:
        os.environ["DS_ACCELERATOR"] = "cpu"
        logger.info("no CUDA device: DS_ACCELERATOR=cpu (gloo backend)")
    if not torch.distributed.is_initialized() and "WORLD_SIZE" not in os.environ:
        port = free_port()
        for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"),
                           ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(port))):
            os.environ.setdefault(key, value)
        logger.info("no distributed environment: running as a single rank (port %d)", port)


def init_distributed() -> None:
    """Join (or create) the default process group DeepSpeed will use."""
    prepare_environment()
    import deepspeed  # late: must follow prepare_environment

    if not torch.distributed.is_initialized():
        deepspeed.init_distributed(dist_backend=comm_backend(), auto_mpi_discovery=False)
