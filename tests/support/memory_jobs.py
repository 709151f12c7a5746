"""Per-rank job for ``persistence.memory_period``'s promise under the local runtime (importable; spawned
through ``tests/support/dist_harness.run_jobs``): a tiny Llama at ZeRO-3 on 2 gloo ranks, its
layers stored once (after step 2), memory versions every step, rank 1 lost after step 5. Three runs
from the same initial state: failure-free, with a budget that holds a whole memory version, and
with one that holds about half of it."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from layercheck.orchestrator.core.memory.budget import memory_version_need
from layercheck.orchestrator.core.recovery.config import SupervisionConfig
from layercheck.orchestrator.local.local_coordinator import LocalCoordinator
from layercheck.orchestrator.local.recovery import recover
from layercheck.orchestrator.local.run import train_with_failures, wipe_training_state
from layercheck.orchestrator.store.layer_store import LayerStore
from layercheck.policies.staggered import BYTES_PER_PARAM
from layercheck.workers.data.dataset import DataConfig, SequenceDataset
from layercheck.workers.engine import TrainEngine, seek_step, shutdown
from layercheck.workers.env import init_distributed
from layercheck.workers.layer_state import restore_from_shards
from tests.support.engines import make_engine
from tests.support.local_jobs import STEPS, STEPS_IN_FLIGHT, ScriptedPolicy, initial_state

#: The step after which rank 1 is lost: its slices of every layer were stored after step 2 only.
FAIL_AFTER = 5
#: Memory versions every step: a kept promise brings every slice back as at the failure.
PERIOD = 1


def memory_promise_job(rank: int, world_size: int, root: str) -> dict[str, Any]:
    init_distributed()
    train_engine = make_engine(stage=3, precision="fp32")
    try:
        initial = initial_state(train_engine)
        numel = train_engine.layer_map.numel
        need = memory_version_need(numel, world_size=world_size, ranks=1).nbytes
        # about half of one rank's memory version (its tensors alone, no header room)
        short = sum(math.ceil(n / world_size) for n in numel.values()) * BYTES_PER_PARAM // 2
        runs = {
            "clean": {"fail_after": (), "memory_bytes": 2 * need},
            "held": {"fail_after": (FAIL_AFTER,), "memory_bytes": need},
            "short": {"fail_after": (FAIL_AFTER,), "memory_bytes": short},
        }
        out: dict[str, Any] = {"need": need, "short": short}
        for name, options in runs.items():
            out[name] = _run(train_engine, initial, Path(root, name), rank=rank, world_size=world_size, **options)
        return out
    finally:
        shutdown(train_engine)


def _run(
    train_engine: TrainEngine,
    initial: list[Any],
    root: Path,
    *,
    rank: int,
    world_size: int,
    fail_after: tuple[int, ...],
    memory_bytes: int,
) -> dict[str, Any]:
    restore_from_shards(train_engine.layout, initial)
    seek_step(train_engine, 0)
    train_engine.optimizer.take_drift()
    names = train_engine.layer_map.names
    coordinator = LocalCoordinator(
        policy=ScriptedPolicy({1: names}),  # every layer stored after step 2, then never again
        layer_numel=train_engine.layer_map.numel,
        store=LayerStore.open(str(root), fsync=False),
        max_inflight_bytes=2**30,
        max_versions_in_flight=STEPS_IN_FLIGHT,
        config=SupervisionConfig(drain_deadline_s=60, commit_backoff_s=0.01),
        memory_bytes=memory_bytes,
        memory_period=PERIOD,
    )

    def on_failure(t_fail: int) -> int:
        wipe_training_state(train_engine)  # the whole group restarts: every slice comes from the composite
        return recover(train_engine, coordinator).start_step

    train_with_failures(
        train_engine,
        SequenceDataset.from_config(DataConfig(seq_len=16, seed=0)),
        coordinator,
        start_step=1,
        end_step=STEPS,
        rank=rank,
        world_size=world_size,
        fail_after=fail_after,
        on_failure=on_failure,
    )
    dropped = coordinator.writer.memory_stats().memory_dropped
    coordinator.close(timeout_s=60)
    out: dict[str, Any] = {"memory_dropped": dropped, "promise": coordinator.memory_promise}
    if rank == 0:
        status = coordinator.status()
        assert status is not None  # rank 0 hosts the supervisor
        out["losses"] = {p.step: p.loss for p in coordinator.progress_log}
        out["recoveries"] = status["account"]["recoveries"]
    return out
