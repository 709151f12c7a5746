"""How each strategy persists state after a step and recovers it after a failure, inside one rank.

Every class has the same three methods the harness calls: ``after_step(step, lr, drift)`` →
the layers whose state was taken at this step; ``recover(t_fail)`` → a :class:`Recovered`
(the step training continues after, and the time split plan / load / replay); ``finish()`` →
waits for the writes and returns bytes and events. Collective calls are made by every rank
in the same order (the policy's decision comes from the all-reduced drift, so every rank
decides the same without asking anyone).
"""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from bench import delta as deltas
from bench.strategies import Kind, Strategy
from bench.writers import BackgroundWriter, LayerStoreWriter, async_checkpoint_engine, tree_bytes
from orchestrator.core.composite import load_composite
from orchestrator.store.recovery_source import resolve_plan
from orchestrator.store.layer_store import LayerStore
from policies.checkpoint_policy import build_policy
from policies.configs import IntervalConfig
from policies.decision import StepObservation
from workers.engine import TrainEngine, seek_step
from workers.host_buffers import HostBufferPool
from workers.layer_state import restore_from_shards, snapshot_layers
from workers.layout import state_view
from workers.shard import STATE_KEYS

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Recovered:
    resume_after: int
    """Training continues at ``resume_after + 1`` (``t_fail`` when nothing is rolled back)."""
    plan_s: float = 0.0
    load_s: float = 0.0
    replay_s: float = 0.0
    """Applying deltas (``differential``); re-run steps of a rollback are timed by the harness."""
    drain_s: float = 0.0
    """Waiting for writes in flight at the failure to land (a surviving writer finishes them)."""
    weighted_staleness: float = 0.0
    max_staleness: int = 0
    versions: Mapping[str, int] | None = None
    """Resume kinds: the step of the version each layer was reloaded from."""


def _barrier() -> None:
    torch.distributed.barrier()


def _broadcast(value: Any) -> Any:
    box = [value]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


class NoPersistence:
    def __init__(self, te: TrainEngine) -> None:
        self.te = te

    def after_step(self, step: int, lr: float, drift: Mapping[str, float]) -> Sequence[str]:
        return ()

    def recover(self, t_fail: int) -> Recovered:
        raise RuntimeError("the 'none' strategy has nothing to recover from (the harness models its restart)")

    def finish(self) -> dict[str, float]:
        return {"bytes": 0, "events": 0}


class DeepSpeedFull:
    """``engine.save_checkpoint`` every ``interval`` steps; rollback with ``load_checkpoint``."""

    def __init__(self, te: TrainEngine, strategy: Strategy, root: Path) -> None:
        self.te = te
        self.interval = strategy.interval
        self.root = root
        self.writer: BackgroundWriter | None = None
        if strategy.kind is Kind.DEEPSPEED_ASYNC:
            self.writer = BackgroundWriter("ds-async-writer", max_pending=4)
            self._saved_engine = te.engine.checkpoint_engine
            te.engine.checkpoint_engine = async_checkpoint_engine(self.writer)
        self.tags: list[int] = []
        self.events = 0
        self.bytes_written = 0

    def after_step(self, step: int, lr: float, drift: Mapping[str, float]) -> Sequence[str]:
        if step % self.interval:
            return ()
        self.te.engine.save_checkpoint(str(self.root), tag=f"step{step}", save_latest=False)
        self.tags.append(step)
        self.events += 1
        if self.writer is None:
            self._account_and_prune()
        else:  # after this tag's files in the writer's queue
            self.writer.submit(self._account_and_prune)
        return tuple(self.te.layer_map.names)

    def _account_and_prune(self) -> None:
        """Count the newest tag's bytes and keep only the newest two tags on disk, as users'
        retention does (a large model's checkpoints add up). Synchronous: rank 0 counts every
        rank's files (``save_checkpoint`` ends with a barrier); asynchronous: each rank counts
        its own writes (see ``finish``) and deletes only its own files."""
        rank = torch.distributed.get_rank()
        if self.writer is None and rank == 0:
            self.bytes_written += tree_bytes(self.root / f"step{self.tags[-1]}")
        for old in self.tags[:-2]:
            directory = self.root / f"step{old}"
            if not directory.is_dir():
                continue
            for file in directory.iterdir():
                if f"rank_{rank}_" in file.name or (rank == 0 and "zero_pp_rank" not in file.name):
                    file.unlink(missing_ok=True)
            if rank == 0:
                try:
                    directory.rmdir()
                except OSError:
                    pass  # another rank's files are still there; they go with its next prune

    def _drain(self) -> float:
        started = time.monotonic()
        if self.writer is not None:
            self.writer.drain()
        _barrier()
        return time.monotonic() - started

    def recover(self, t_fail: int) -> Recovered:
        drain_s = self._drain()
        started = time.monotonic()
        usable = [s for s in self.tags if s <= t_fail and (self.root / f"step{s}").is_dir()]
        plan_s = time.monotonic() - started
        if not usable:
            return Recovered(resume_after=0, plan_s=plan_s, drain_s=drain_s)
        started = time.monotonic()
        self.te.engine.load_checkpoint(str(self.root), tag=f"step{usable[-1]}")
        load_s = time.monotonic() - started
        return Recovered(resume_after=usable[-1], plan_s=plan_s, load_s=load_s, drain_s=drain_s,
                         weighted_staleness=float(t_fail - usable[-1]), max_staleness=t_fail - usable[-1])

    def finish(self) -> dict[str, float]:
        self._drain()
        if self.writer is None:
            return {"bytes": self.bytes_written, "events": self.events}  # rank 0 counted every rank's files
        self.writer.close()
        written = self.te.engine.checkpoint_engine.bytes_written  # this rank's files
        self.te.engine.checkpoint_engine = self._saved_engine
        return {"bytes": written, "events": self.events}


class LayerStorePersistence:
    """A policy's decisions carried out through the LayerStore (async writer thread); recovery
    plans the composite at ``t_fail`` and resumes at ``t_fail + 1``."""

    def __init__(self, te: TrainEngine, strategy: Strategy, root: Path) -> None:
        self.te = te
        rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
        config = strategy.policy if strategy.kind is Kind.LAYER_POLICY else IntervalConfig(interval=strategy.interval)
        self.policy = build_policy(config, te.layer_map.numel)
        self.store = LayerStore.open(str(root / "store"), fsync=True)
        self.pool = HostBufferPool()
        self.writer = BackgroundWriter(f"store-writer-{rank}", max_pending=4)
        self.store_writer = LayerStoreWriter(self.store, root / "receipts", rank=rank, world_size=world, pool=self.pool)
        self.events = 0

    def after_step(self, step: int, lr: float, drift: Mapping[str, float]) -> Sequence[str]:
        decision = self.policy.observe(StepObservation(step=step, lr=lr, drift=drift))
        if not decision:
            return ()
        self.persist(step, decision.names, base=decision.is_base)
        return decision.names

    def persist(self, step: int, names: Sequence[str], *, base: bool) -> None:
        shards = snapshot_layers(self.te.layout, names, self.pool, step=step)
        self.writer.submit(lambda: self.store_writer.write(shards, base=base))
        self.events += 1

    def _drain(self) -> float:
        started = time.monotonic()
        self.writer.drain()
        _barrier()
        return time.monotonic() - started

    def load(self, t_fail: int) -> tuple[float, float, Any]:
        """Plan (rank 0, as the supervisor does) and load the composite at ``t_fail`` (collective)."""
        started = time.monotonic()
        resolved = None
        if torch.distributed.get_rank() == 0:
            resolved = resolve_plan(self.store, self.te.layer_map.numel, t_fail, deep=False)
        resolved = _broadcast(resolved)
        plan_s = time.monotonic() - started
        load_s = load_composite(self.te, self.store, resolved.records)
        return plan_s, load_s, resolved

    def recover(self, t_fail: int) -> Recovered:
        drain_s = self._drain()
        plan_s, load_s, resolved = self.load(t_fail)
        seek_step(self.te, t_fail)
        versions = {layer: r.step for layer, r in resolved.records.items()}
        self.policy.rebase(versions)  # as the policy service does after a recovery
        return Recovered(resume_after=t_fail, plan_s=plan_s, load_s=load_s, drain_s=drain_s,
                         weighted_staleness=resolved.plan.weighted_staleness, max_staleness=resolved.plan.max_staleness,
                         versions=versions)

    def finish(self) -> dict[str, float]:
        self._drain()
        self.writer.close()
        return {"bytes": self.store_writer.bytes_written, "events": self.events}


class Differential(LayerStorePersistence):
    """Every layer every ``interval`` steps through the LayerStore, plus a top-k delta of every
    layer's state each step in between; recovery loads the last full and replays the deltas.

    The delta is encoded on the training thread where the optimizer state lives (on the GPU
    there, as gradient compression would be), so its cost is stall; only the small indices and
    values go to host memory and the writer thread."""

    def __init__(self, te: TrainEngine, strategy: Strategy, root: Path) -> None:
        super().__init__(te, strategy, root)
        self.interval = strategy.interval
        self.encoder = deltas.DeltaEncoder(strategy.delta_density)
        self.delta_root = root / "deltas"
        self.delta_root.mkdir(parents=True, exist_ok=True)
        self.rank = torch.distributed.get_rank()
        self.names = tuple(te.layer_map.names)
        self.last_full: int | None = None
        self.delta_bytes = 0

    def _device_state(self) -> dict[tuple[str, str], torch.Tensor]:
        """This rank's owned state of every layer as flat tensors, in ``snapshot_layers`` order."""
        out = {}
        for name in self.names:
            owned = self.te.layout[name].owned
            for key in STATE_KEYS:
                views = [state_view(self.te.layout.optimizer, piece, key) for piece in owned]
                out[(name, key)] = torch.cat(views) if views else torch.empty(0)
        return out

    def after_step(self, step: int, lr: float, drift: Mapping[str, float]) -> Sequence[str]:
        if step % self.interval == 0:
            self.persist(step, self.names, base=False)
            self.encoder.reset_tensors(self._device_state())
            self.last_full = step
            return self.names
        if self.last_full is None:
            return ()
        encoded = self.encoder.encode_tensors(self._device_state())
        self.writer.submit(lambda: self._write_delta(step, encoded))
        self.events += 1
        return self.names

    def _write_delta(self, step: int, encoded: Mapping[str, torch.Tensor]) -> None:
        self.delta_bytes += deltas.write_delta(self.delta_root, step, self.rank, encoded)

    def recover(self, t_fail: int) -> Recovered:
        drain_s = self._drain()
        if self.last_full is None:
            raise RuntimeError("differential: a failure before the first full checkpoint")
        plan_s, load_s, resolved = self.load(t_fail)
        full_step = max(r.step for r in resolved.records.values())
        started = time.monotonic()
        shards = snapshot_layers(self.te.layout, self.names, HostBufferPool(), step=t_fail)
        deltas.replay(shards, self.delta_root, range(full_step + 1, t_fail + 1), self.rank)
        for shard in shards:
            shard.optimizer_step = t_fail  # every layer's Adam took a step at every step
        restore_from_shards(self.te.layout, shards)
        self.encoder.reset_tensors(self._device_state())
        replay_s = time.monotonic() - started
        seek_step(self.te, t_fail)
        return Recovered(resume_after=t_fail, plan_s=plan_s, load_s=load_s, replay_s=replay_s, drain_s=drain_s,
                         versions={name: t_fail for name in self.names})

    def finish(self) -> dict[str, float]:
        out = super().finish()
        return {"bytes": out["bytes"] + self.delta_bytes, "events": self.events}


def make_persistence(te: TrainEngine, strategy: Strategy, root: Path) -> Any:
    root.mkdir(parents=True, exist_ok=True)
    if strategy.kind is Kind.NONE:
        return NoPersistence(te)
    if strategy.kind in (Kind.DEEPSPEED_SYNC, Kind.DEEPSPEED_ASYNC):
        return DeepSpeedFull(te, strategy, root)
    if strategy.kind is Kind.DIFFERENTIAL:
        return Differential(te, strategy, root)
    return LayerStorePersistence(te, strategy, root)
