"""A warm spare's run of a user's loop (``CheckpointConfig(in_place=True, spares=1)``), in one
spawned process (tests/support/dist_harness.py: torch's and DeepSpeed's process-wide state stays
there). Ray Train's world: worker 0 trains rank 0, worker 1 (this process) is the spare. The run's
supervisor is stood in for by its real parts (the roster and the rendezvous), called directly; Ray
Train's context is its real one. Must be importable."""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import ray
import ray.train
import torch

from layercheck.orchestrator.core.recovery.rendezvous import Rendezvous
from layercheck.orchestrator.core.run_config import FaultConfig
from layercheck.orchestrator.runtime.context import WorkerContext, call_with_context, incarnation
from layercheck.orchestrator.runtime.spares import SpareRoster

SPARE = 1  # Ray Train's world rank of this process


class _Method:
    def __init__(self, fn: Any) -> None:
        self.remote = fn


class StandInSupervisor:
    """The supervisor actor's spare and rendezvous methods, on its real roster and rendezvous."""

    def __init__(self) -> None:
        self.roster = SpareRoster(world_size=1, spares=1)
        point = Rendezvous()
        self.role = _Method(self.roster.role)
        self.spare_wait = _Method(self.roster.wait)
        self.rank_finished = _Method(self.roster.finish)
        self.rendezvous = _Method(
            lambda rank, ws, host, port, timeout_s: point.arrive(rank, ws, host, port, timeout_s=timeout_s)
        )

    def waiting(self) -> bool:
        return self.roster.view()["waiting"] == 1


def _as_a_spare(supervisor: StandInSupervisor) -> WorkerContext:
    """This process as Ray Train's worker 1 of 2 in an in-place run with one spare."""
    from ray.train.v2._internal.execution.context import DistributedContext, TrainContext, set_train_context
    from ray.train.v2._internal.execution.train_fn_utils import DistributedTrainFnUtils, set_train_fn_utils

    ray.get = lambda value, timeout=None: value  # the stand-in answers at once
    ray.get_actor = lambda name, namespace=None: supervisor
    ray.util.get_node_ip_address = lambda: "127.0.0.1"
    os.environ.pop("RANK", None)
    ranks = DistributedContext(world_rank=SPARE, world_size=2, local_rank=0, local_world_size=1, node_rank=0)
    set_train_context(TrainContext(None, ranks, None, None, None, None, None))  # type: ignore[arg-type]
    set_train_fn_utils(DistributedTrainFnUtils())  # what a Ray Train worker has: ray.train.get_context()
    return WorkerContext(
        run_id="spare-test",
        storage_uri="/nonexistent",
        fsync=False,
        max_inflight_bytes=1,
        fault=FaultConfig(),
        drift_probe="snapshot_diff",
        layer_map=None,
        layer_numel={},
        in_place=True,
        spares=1,
        regroup_timeout_s=30.0,
    )


def _when(condition: Any, then: Any) -> threading.Thread:
    """Run ``then()`` from another thread once ``condition()`` holds (as Ray Train's controller would)."""

    def wait() -> None:
        while not condition():
            time.sleep(0.01)
        then()

    thread = threading.Thread(target=wait, daemon=True)
    thread.start()
    return thread


def spare_takes_the_lost_rank(rank: int, world_size: int) -> dict[str, Any]:
    """The spare runs the loop up to its rank, waits, is promoted when worker 0 is replaced, and
    goes on as rank 0: what the loop saw, and when."""
    supervisor = StandInSupervisor()
    context = _as_a_spare(supervisor)
    seen: dict[str, Any] = {}

    def loop() -> dict[str, Any]:
        import transformers

        torch.manual_seed(0)
        config = transformers.LlamaConfig(
            vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2
        )
        transformers.AutoModelForCausalLM.from_config(config)
        seen["built_at"] = time.time()
        seen["group_before_rank"] = torch.distributed.distributed_c10d.GroupMember.WORLD is not None
        ray_rank = ray.train.get_context().get_world_rank()  # a spare: waits for its promotion here
        seen["ranked_at"] = time.time()
        return {
            "ray": [ray_rank, ray.train.get_context().get_world_size()],
            "env": [os.environ["RANK"], os.environ["WORLD_SIZE"]],
            "group": [torch.distributed.get_rank(), torch.distributed.get_world_size()],
            "spare": incarnation().spare,
        }

    def promote() -> None:
        seen["promoted_at"] = time.time()
        supervisor.roster.replacing([0])  # Ray Train replaces worker 0: the spare takes rank 0

    _when(lambda: supervisor.waiting() and "built_at" in seen, promote)
    result = call_with_context(loop, context)
    start = incarnation().rank_start(0, time.time()).to_json()
    return {
        **result,
        "built_before_promotion": seen["built_at"] <= seen["promoted_at"] <= seen["ranked_at"],
        "group_before_rank": seen["group_before_rank"],
        "counted_from_promotion": incarnation().counted_from >= seen["promoted_at"],
        "start": start,
        "ended": supervisor.roster.role(SPARE).kind,  # rank 0 trained to the end: the run is over
        "group_left": not torch.distributed.is_initialized(),
    }


def spare_not_needed(rank: int, world_size: int) -> dict[str, Any]:
    """The run ends while the spare waits in the loop's first question to torch: the loop unwinds,
    its ``except Exception`` untouched, and the spare's train function returns."""
    supervisor = StandInSupervisor()
    context = _as_a_spare(supervisor)
    seen: dict[str, Any] = {"caught": [], "after": False, "finally": False}

    def loop() -> str:
        try:
            torch.distributed.is_initialized()  # as deepspeed.initialize or accelerate ask: waits
            seen["after"] = True
        except Exception as error:  # noqa: BLE001 - what a user's loop may do
            seen["caught"].append(repr(error))
        finally:
            seen["finally"] = True
        return "trained"

    _when(supervisor.waiting, lambda: supervisor.roster.finish(0))
    returned = call_with_context(loop, context)
    return {"returned": returned, **seen, "group": torch.distributed.is_initialized()}


def both(rank: int, world_size: int) -> dict[str, Any]:
    """:func:`spare_not_needed`, then :func:`spare_takes_the_lost_rank`, in one process (one start
    and one round of imports for both tests)."""
    return {"not_needed": spare_not_needed(rank, world_size), "promoted": spare_takes_the_lost_rank(rank, world_size)}
