"""Per-rank jobs for the local runtime's tests (spawned through layercheck.orchestrator.local.spawn; importable).

One job trains a tiny Llama on 2 gloo ranks through ``layercheck.workers.loop.run_loop`` and the
:class:`LocalCoordinator` in several scenarios, and returns plain values to assert on.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from layercheck.orchestrator.core.recovery.config import SupervisionConfig
from layercheck.orchestrator.local.local_coordinator import LocalCoordinator
from layercheck.orchestrator.local.recovery import recover
from layercheck.orchestrator.local.run import train_with_failures, wipe_training_state
from layercheck.orchestrator.store.layer_store import LayerStore
from layercheck.policies.checkpoint_policy import build_policy
from layercheck.policies.configs import IntervalConfig, StaggeredConfig
from layercheck.policies.decision import PersistDecision, Reason, StepObservation
from layercheck.workers.data.dataset import DataConfig, SequenceDataset
from layercheck.workers.engine import TrainEngine, seek_step, shutdown
from layercheck.workers.env import init_distributed
from layercheck.workers.host_buffers import HostBufferPool
from layercheck.workers.layer_state import restore_from_shards, snapshot_layers
from tests.support.engines import make_engine

STEPS = 7
#: The tests persist every layer every step: nothing may be held back waiting for a commit.
STEPS_IN_FLIGHT = 64


class ScriptedPolicy:
    """Names the layers a script gives for a step (a fake policy: which layers, not why)."""

    def __init__(self, script: Mapping[int, Sequence[str]]) -> None:
        self.script = {step: tuple(names) for step, names in script.items()}

    def observe(self, obs: StepObservation) -> PersistDecision:
        return PersistDecision.of(obs.step, {name: Reason.DRIFT for name in self.script.get(obs.step, ())})

    def rebase(self, persisted_steps: Mapping[str, int]) -> None:
        pass


class FailFirstCommit:
    """A store hook: the first commit record cannot be written (as a full or flaky store)."""

    def __init__(self) -> None:
        self.failed = False

    def __call__(self, event: str, rel: str) -> None:
        if event == "opened" and rel.startswith("manifest/") and not self.failed:
            self.failed = True
            raise OSError(5, "injected: the commit record cannot be written")


class DamageAfterWrite:
    """A store hook: flips a data byte of ``layer``'s shard at ``step`` once it is in place
    (silent corruption the checksum catches at load)."""

    def __init__(self, layer: str, step: int) -> None:
        self.prefix = f"layers/{layer}/{step:010d}-"
        self.root: Path | None = None

    def __call__(self, event: str, rel: str) -> None:
        if event == "renamed" and rel.startswith(self.prefix):
            assert self.root is not None
            path = self.root / rel
            data = bytearray(path.read_bytes())
            data[-3] ^= 0x55
            path.write_bytes(bytes(data))


def _run(
    train_engine: TrainEngine,
    initial: list[Any],
    policy: Any,
    root: Path,
    *,
    rank: int,
    world_size: int,
    fail_after: Sequence[int] = (),
    hook: Any = None,
    drift_every: int = 1,
) -> dict[str, Any]:
    restore_from_shards(train_engine.layout, initial)
    seek_step(train_engine, 0)
    train_engine.optimizer.take_drift()
    store = LayerStore.open(str(root), fsync=False, hook=hook)
    if isinstance(hook, DamageAfterWrite):
        hook.root = Path(store.fs.root)
    coordinator = LocalCoordinator(
        policy=policy,
        layer_numel=train_engine.layer_map.numel,
        store=store,
        max_inflight_bytes=2**30,
        max_versions_in_flight=STEPS_IN_FLIGHT,
        drift_every=drift_every,
        config=SupervisionConfig(drain_deadline_s=60, commit_backoff_s=0.01),
    )
    recoveries = []

    def on_failure(t_fail: int) -> int:
        wipe_training_state(train_engine)
        recovered = recover(train_engine, coordinator)
        recoveries.append(
            {
                "t_fail": recovered.t_fail,
                "start_step": recovered.start_step,
                "versions": recovered.versions,
                "drained": recovered.drained,
                "unusable": list(recovered.unusable),
            }
        )
        return recovered.start_step

    dataset = SequenceDataset.from_config(DataConfig(seq_len=16, seed=0))
    train_with_failures(
        train_engine,
        dataset,
        coordinator,
        start_step=1,
        end_step=STEPS,
        rank=rank,
        world_size=world_size,
        fail_after=fail_after,
        on_failure=on_failure,
    )
    drained = coordinator.close(timeout_s=60)
    out = {
        "handed": [[step, list(names)] for step, names in coordinator.handed],
        "recoveries": recoveries,
        "drained": drained,
        "decided": {str(o.step): o.drift for o in coordinator.service.trace},
    }
    if rank == 0:
        out["losses"] = {str(p.step): p.loss for p in coordinator.progress_log}
        out["manifest"] = sorted([r.layer, r.step, sorted(s.rank for s in r.shards)] for r in store.versions())
        status = coordinator.status()
        out["status"] = {
            key: status[key]
            for key in (
                "state",
                "attempt",
                "versions_committed",
                "lost_versions",
                "commit_retries",
                "write_failures",
                "step",
            )
        }
        out["account"] = {key: status["account"][key] for key in ("failures", "recoveries")}
    return out


def loop_scenarios(rank: int, world_size: int, root: str) -> dict[str, Any]:
    init_distributed()
    train_engine = make_engine(stage=2, precision="fp32")
    try:
        initial = initial_state(train_engine)
        names = train_engine.layer_map.names
        every = build_policy(IntervalConfig(interval=1), train_engine.layer_map.numel)
        return {
            "layers": list(names),
            "scripted": _run(
                train_engine,
                initial,
                ScriptedPolicy({2: [names[0]], 3: [names[1], names[-1]]}),
                Path(root, "scripted"),
                rank=rank,
                world_size=world_size,
            ),
            "every": _run(train_engine, initial, every, Path(root, "every"), rank=rank, world_size=world_size),
            "failed": _run(
                train_engine,
                initial,
                build_policy(IntervalConfig(interval=1), train_engine.layer_map.numel),
                Path(root, "failed"),
                rank=rank,
                world_size=world_size,
                fail_after=(4,),
            ),
            # rank 0's store fails the first commit: the supervisor's commit path retries it
            "retried": _run(
                train_engine,
                initial,
                ScriptedPolicy({2: [names[0]]}),
                Path(root, "retried"),
                rank=rank,
                world_size=world_size,
                hook=FailFirstCommit() if rank == 0 else None,
            ),
            # rank 1's shard of layer 1's newest version is damaged after it is written: only rank 1
            # finds out, while loading; every rank falls back to the version before
            "corrupt": _run(
                train_engine,
                initial,
                build_policy(IntervalConfig(interval=1), train_engine.layer_map.numel),
                Path(root, "corrupt"),
                rank=rank,
                world_size=world_size,
                fail_after=(4,),
                hook=DamageAfterWrite(names[1], 4) if rank == 1 else None,
            ),
            "staggered": _run(
                train_engine,
                initial,
                build_policy(StaggeredConfig(period=3), train_engine.layer_map.numel),
                Path(root, "staggered"),
                rank=rank,
                world_size=world_size,
                fail_after=(4,),
                drift_every=StaggeredConfig().drift_every,  # quiet steps: decided in advance, completed later
            ),
        }
    finally:
        shutdown(train_engine)


def initial_state(train_engine: Any) -> list[Any]:
    """Every layer's shards of this rank at step 0, copied out of the host buffers."""
    layers = train_engine.layer_map.names
    return [_clone(s) for s in snapshot_layers(train_engine.layout, layers, HostBufferPool(pin=False), step=0)]


def _clone(shard: Any) -> Any:
    from dataclasses import replace

    return replace(shard, tensors={k: v.clone() for k, v in shard.tensors.items()})
