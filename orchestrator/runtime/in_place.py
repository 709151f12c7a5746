"""In-place recovery (``cluster.in_place``): when a worker dies, Ray Train replaces only that
worker and the survivors go on in their own processes.

Ray Train 2.60 replaces only the failing workers when the backend declares replica groups
(``has_replica_groups``, as its torchft backend does): it keeps the placement group and the
surviving workers, starts a new worker in the freed slot and runs the train function there from
the top (``WorkerGroup.replace_replica_group``). It then forms no process group across the
workers, so the ranks form theirs through the supervisor (:class:`~layercheck.orchestrator.core.rendezvous.Rendezvous`),
one generation after each loss. What a survivor does when its step raises is in
:func:`layercheck.orchestrator.runtime.train_fn.train_fn`; if anything on that path fails, the
survivor's train function raises and Ray Train falls back to its full restart.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import ray
import torch
from ray.train.torch import TorchConfig
from ray.train.torch.config import _TorchBackend

from layercheck.orchestrator.runtime.names import NAMESPACE
from layercheck.workers.env import free_port

logger = logging.getLogger(__name__)


class _InPlaceBackend(_TorchBackend):
    """Each worker a replica group of its own; no process group formed by Ray Train."""

    has_replica_groups: bool = True

    def on_start(self, worker_group: Any, backend_config: Any) -> None:
        """Nothing: the ranks form their process group through the supervisor."""


class InPlaceTorchConfig(TorchConfig):
    """The ``torch_config`` of a ``TorchTrainer`` whose lost workers are replaced in place."""

    @property
    def backend_cls(self) -> type[_InPlaceBackend]:
        return _InPlaceBackend


def form_group(supervisor: Any, rank: int, world_size: int, *, timeout_s: float) -> int:
    """Meet the other ranks at the supervisor and set the environment ``deepspeed.init_distributed``
    reads (``env://``) to the generation's group; returns the generation. Rank 0 serves the
    group's store on a port free here a moment ago."""
    host = ray.util.get_node_ip_address()
    port = free_port() if rank == 0 else 0
    address = ray.get(supervisor.rendezvous.remote(rank, world_size, host, port, timeout_s))
    os.environ.update(
        MASTER_ADDR=address.host,
        MASTER_PORT=str(address.port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=os.environ.get("LOCAL_RANK", "0"),
    )
    logger.info("rank %d: process group generation %d at %s:%d", rank, address.generation, address.host, address.port)
    return int(address.generation)


def lost_a_peer(error: BaseException) -> bool:
    """Whether a step's error is what a survivor sees when a peer dies: a collective that failed
    (gloo: the connection closed; NCCL: aborted) or Ray Train's barrier reset by the replacement."""
    from ray.train.v2._internal.execution.checkpoint.sync_actor import SynchronizationBarrierResetError

    if isinstance(error, SynchronizationBarrierResetError | torch.distributed.DistError):
        return True
    return isinstance(error, RuntimeError) and any(sign in str(error) for sign in PEER_LOSS_SIGNS)


def leave_in_place(supervisor_name: str, rank: int, error: BaseException, *, recovering: bool) -> None:
    """Tell the supervisor why this rank raises out of its train function (Ray Train then restarts
    the group): a failed recovery in this process (``recovering``), or an error of its own step that
    is no lost peer. Best effort, never in the way of the error: unsaid, the summary says that no
    rank survived."""
    reason = "recovery_failed" if recovering else "rank_failed"
    text = str(error).splitlines()[0][:300] if str(error) else ""
    try:
        supervisor = ray.get_actor(supervisor_name, namespace=NAMESPACE)
        ray.get(supervisor.in_place_refused.remote(rank, reason, f"{type(error).__name__}: {text}"), timeout=10)
    except Exception as failure:  # noqa: BLE001 - see above
        logger.warning("rank %d could not say why it leaves in-place recovery: %s", rank, failure)


#: What a collective's ``RuntimeError`` says when its peer died (gloo's TCP transport).
PEER_LOSS_SIGNS = ("Connection closed by peer", "Connection reset by peer", "gloo/transport/tcp")
