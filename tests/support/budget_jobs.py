"""Per-rank job for the write-budget test of the local runtime (spawned; importable)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from layercheck.orchestrator.core.persistence.write_budget import WriteBudgetConfig
from layercheck.orchestrator.core.recovery.config import SupervisionConfig
from layercheck.orchestrator.local.local_coordinator import LocalCoordinator
from layercheck.orchestrator.local.run import train_with_failures
from layercheck.orchestrator.store.layer_store import LayerStore
from layercheck.policies.checkpoint_policy import build_policy
from layercheck.policies.configs import StaggeredConfig
from layercheck.workers.data.dataset import DataConfig, SequenceDataset
from layercheck.workers.engine import seek_step, shutdown
from layercheck.workers.env import init_distributed
from layercheck.workers.host_buffers import HostBufferPool
from layercheck.workers.layer_state import restore_from_shards, snapshot_layers
from tests.support.engines import make_engine

STEPS = 16
CAP = 20_000  # bytes per step: a fraction of the tiny model's state (~0.9 MB) per period of 2


def _run(
    train_engine: Any, initial: list[Any], root: Path, budget: WriteBudgetConfig | None, *, rank: int, world_size: int
) -> dict[str, Any]:
    restore_from_shards(train_engine.layout, initial)
    seek_step(train_engine, 0)
    train_engine.optimizer.take_drift()
    policy = build_policy(StaggeredConfig(period=2), train_engine.layer_map.numel)
    coordinator = LocalCoordinator(
        policy=policy,
        layer_numel=train_engine.layer_map.numel,
        store=LayerStore.open(str(root), fsync=False),
        max_inflight_bytes=2**30,
        config=SupervisionConfig(drain_deadline_s=60),
        write_budget=budget,
    )
    dataset = SequenceDataset.from_config(DataConfig(seq_len=16, seed=0))
    train_with_failures(
        train_engine, dataset, coordinator, start_step=1, end_step=STEPS, rank=rank, world_size=world_size
    )
    coordinator.close(timeout_s=60)
    numel = train_engine.layer_map.numel
    return {
        "budgets": [o.write_budget_bytes for o in coordinator.service.trace],
        "handed_params": sum(numel[n] for _, names in coordinator.handed for n in names),
        "plan_budget": policy.budget,
        "binding": policy.external_binding,
    }


def budget_job(rank: int, world_size: int, root: str, cap: int) -> dict[str, Any]:
    init_distributed()
    train_engine = make_engine(stage=2, precision="fp32")
    try:
        initial = [
            s
            for s in snapshot_layers(
                train_engine.layout, train_engine.layer_map.names, HostBufferPool(pin=False), step=0
            )
        ]
        initial = [type(s)(**{**s.__dict__, "tensors": {k: v.clone() for k, v in s.tensors.items()}}) for s in initial]
        return {
            "free": _run(train_engine, initial, Path(root, "free"), None, rank=rank, world_size=world_size),
            "measured": _run(
                train_engine, initial, Path(root, "measured"), WriteBudgetConfig(), rank=rank, world_size=world_size
            ),
            "capped": _run(
                train_engine,
                initial,
                Path(root, "capped"),
                WriteBudgetConfig(cap_bytes_per_step=cap),
                rank=rank,
                world_size=world_size,
            ),
            "model_bytes": sum(train_engine.layer_map.numel.values()) * 12,
        }
    finally:
        shutdown(train_engine)
