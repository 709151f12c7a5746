"""Per-rank jobs for the local runtime's tests (spawned through orchestrator.local.spawn; importable).

One job trains a tiny Llama on 2 gloo ranks through ``workers.loop.run_loop`` and the
:class:`LocalCoordinator` in several scenarios, and returns plain values to assert on.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from orchestrator.local.coordinator import LocalCoordinator
from orchestrator.local.recovery import recover
from orchestrator.local.run import train_with_failures, wipe_training_state
from orchestrator.store.layer_store import LayerStore
from policies.checkpoint_policy import build_policy
from policies.configs import IntervalConfig, StaggeredConfig
from policies.decision import PersistDecision, Reason, StepObservation
from tests.worker_jobs import make_engine
from workers.data import DataConfig, SequenceDataset
from workers.engine import TrainEngine, seek_step, shutdown
from workers.env import init_distributed
from workers.host_buffers import HostBufferPool
from workers.layer_state import restore_from_shards, snapshot_layers

STEPS = 7


class ScriptedPolicy:
    """Names the layers a script gives for a step (a fake policy: which layers, not why)."""

    def __init__(self, script: Mapping[int, Sequence[str]]) -> None:
        self.script = {step: tuple(names) for step, names in script.items()}

    def observe(self, obs: StepObservation) -> PersistDecision:
        return PersistDecision.of(obs.step, {name: Reason.DRIFT for name in self.script.get(obs.step, ())})

    def rebase(self, persisted_steps: Mapping[str, int]) -> None:
        pass


def _run(te: TrainEngine, initial: list[Any], policy: Any, root: Path, *, rank: int, world_size: int,
         fail_after: Sequence[int] = ()) -> dict[str, Any]:
    restore_from_shards(te.layout, initial)
    seek_step(te, 0)
    te.optimizer.take_drift()
    store = LayerStore.open(str(root), fsync=False)
    coordinator = LocalCoordinator(policy=policy, layers=te.layer_map.names, store=store, max_inflight_bytes=2**30)
    recoveries = []

    def on_failure(t_fail: int) -> int:
        wipe_training_state(te)
        recovered = recover(te, coordinator, layer_numel=te.layer_map.numel, drain_timeout_s=60)
        recoveries.append({"t_fail": recovered.t_fail, "start_step": recovered.start_step,
                           "versions": recovered.versions})
        return recovered.start_step

    dataset = SequenceDataset.from_config(DataConfig(seq_len=16, seed=0))
    train_with_failures(te, dataset, coordinator, start_step=1, end_step=STEPS, rank=rank, world_size=world_size,
                        fail_after=fail_after, on_failure=on_failure)
    drained = coordinator.close(timeout_s=60)
    out = {"handed": [[step, list(names)] for step, names in coordinator.handed], "recoveries": recoveries,
           "drained": drained, "decided": {str(o.step): o.drift for o in coordinator.service.trace}}
    if rank == 0:
        out["losses"] = {str(p.step): p.loss for p in coordinator.progress_log}
        out["committed"] = sorted([layer, step] for layer, step in coordinator.committer.log.committed)
        out["manifest"] = sorted([r.layer, r.step, sorted(s.rank for s in r.shards)] for r in store.versions())
    return out


def loop_scenarios(rank: int, world_size: int, root: str) -> dict[str, Any]:
    init_distributed()
    te = make_engine(stage=2, precision="fp32")
    try:
        initial = [_clone(s) for s in snapshot_layers(te.layout, te.layer_map.names, HostBufferPool(pin=False), step=0)]
        names = te.layer_map.names
        every = build_policy(IntervalConfig(interval=1), te.layer_map.numel)
        return {
            "layers": list(names),
            "scripted": _run(te, initial, ScriptedPolicy({2: [names[0]], 3: [names[1], names[-1]]}),
                             Path(root, "scripted"), rank=rank, world_size=world_size),
            "every": _run(te, initial, every, Path(root, "every"), rank=rank, world_size=world_size),
            "failed": _run(te, initial, build_policy(IntervalConfig(interval=1), te.layer_map.numel),
                           Path(root, "failed"), rank=rank, world_size=world_size, fail_after=(4,)),
            "staggered": _run(te, initial, build_policy(StaggeredConfig(period=3), te.layer_map.numel),
                              Path(root, "staggered"), rank=rank, world_size=world_size, fail_after=(4,)),
        }
    finally:
        shutdown(te)


def _clone(shard: Any) -> Any:
    from dataclasses import replace

    return replace(shard, tensors={k: v.clone() for k, v in shard.tensors.items()})
