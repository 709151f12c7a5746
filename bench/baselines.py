"""The baselines' own checkpointing, run from the training loop's ``after_step`` hook.

The loop, the drift reports and the policy service are LayerCheck's (a ``never`` policy for
the DeepSpeed baselines, the ``interval`` policy for the full part of ``diff``); what differs is
here: DeepSpeed's ``save_checkpoint`` (synchronous, or with an asynchronous checkpoint engine)
with rollback recovery, and the differential baseline's per-step top-k deltas (under FSDP2, DCP's
saves take DeepSpeed's place: :mod:`layercheck.bench.dcp_baseline`).

Each baseline has ``after_step(step)``, ``recover(t_fail) -> dict`` (after the in-memory state
was wiped; returns the step to resume at and its timings), ``finish() -> (bytes, events)``, and
``persisted`` (per step, the layers whose state was saved at it) for the freshness figures.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from layercheck.bench import delta as deltas
from layercheck.bench.dcp_baseline import DCPFull
from layercheck.bench.strategies import Kind, Strategy
from layercheck.orchestrator.local.local_coordinator import LocalCoordinator
from layercheck.orchestrator.local.recovery import recover
from layercheck.workers.engine import TrainEngine, seek_step
from layercheck.workers.host_buffers import HostBufferPool
from layercheck.workers.layer_state import restore_from_shards, snapshot_layers
from layercheck.workers.layout import state_view
from layercheck.workers.shard import STATE_KEYS
from layercheck.workers.step import train_step

logger = logging.getLogger(__name__)


class JobThread:
    """A baseline's background writes, in submission order on one thread; a bounded queue makes
    the trainer wait when storage falls behind (counted as stall)."""

    def __init__(self, name: str, max_pending: int = 4) -> None:
        self._queue: queue.Queue[Callable[[], None] | None] = queue.Queue(maxsize=max_pending)
        self._errors: list[BaseException] = []
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (job := self._queue.get()) is not None:
            try:
                job()
            except BaseException as error:  # kept for drain(); the thread carries on
                logger.exception("background write failed")
                self._errors.append(error)
            finally:
                self._queue.task_done()

    def submit(self, job: Callable[[], None]) -> None:
        self._queue.put(job)

    def drain(self) -> None:
        """Wait until every job has run; raise the first error any of them raised."""
        self._queue.join()
        if self._errors:
            raise RuntimeError(f"{len(self._errors)} background write(s) failed") from self._errors[0]

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()


class DeepSpeedFull:
    """``engine.save_checkpoint`` every ``interval`` steps; rollback with ``load_checkpoint``
    and re-run the lost steps."""

    def __init__(
        self,
        train_engine: TrainEngine,
        strategy: Strategy,
        root: Path,
        coordinator: LocalCoordinator,
        *,
        batches: Callable[[int], list[torch.Tensor]],
        losses: Callable[[], dict[int, float]],
        reset: Callable[[], None],
    ) -> None:
        self.train_engine, self.interval, self.root, self.coordinator = (
            train_engine,
            strategy.interval,
            root,
            coordinator,
        )
        self.batches, self.losses, self.reset = batches, losses, reset
        self.writer: JobThread | None = None
        if strategy.kind is Kind.DEEPSPEED_ASYNC:
            self.writer = JobThread("ds-async-writer")
            self._saved_engine = train_engine.engine.checkpoint_engine
            train_engine.engine.checkpoint_engine = async_checkpoint_engine(self.writer)
        self.tags: list[int] = []
        self.persisted: dict[int, tuple[str, ...]] = {}
        self.stall_s = 0.0
        self.bytes_written = 0

    def after_step(self, step: int) -> None:
        if step % self.interval:
            return
        started = time.monotonic()
        self.train_engine.engine.save_checkpoint(str(self.root), tag=f"step{step}", save_latest=False)
        self.tags.append(step)
        if self.writer is None:
            self._account_and_prune()
        else:  # after this tag's files in the writer's queue
            self.writer.submit(self._account_and_prune)
        self.persisted[step] = tuple(self.train_engine.layer_map.names)
        self.stall_s += time.monotonic() - started

    def _account_and_prune(self) -> None:
        """Count the newest tag's bytes and keep only the newest two tags on disk, as users'
        retention does. Synchronous: rank 0 counts every rank's files (``save_checkpoint`` ends
        with a barrier); asynchronous: each rank counts its own writes and deletes its own files."""
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
        torch.distributed.barrier()
        return time.monotonic() - started

    def recover(self, t_fail: int) -> dict[str, Any]:
        self.coordinator.last_complete_step()  # every rank's report of t_fail is in, as in LayerCheck's recovery
        drain_s = self._drain()
        started = time.monotonic()
        usable = [s for s in self.tags if s <= t_fail and (self.root / f"step{s}").is_dir()]
        plan_s = time.monotonic() - started
        started = time.monotonic()
        if usable:
            self.train_engine.engine.load_checkpoint(str(self.root), tag=f"step{usable[-1]}")
        else:
            self.reset()  # nothing saved yet: back to the initial weights
        load_s = time.monotonic() - started
        resume_after = usable[-1] if usable else 0
        started = time.monotonic()
        replay_diff, losses = 0.0, self.losses()
        for step in range(resume_after + 1, t_fail + 1):
            loss, _ = train_step(self.train_engine, self.batches(step))
            replay_diff = max(replay_diff, abs(loss - losses[step]) if step in losses else 0.0)
        replay_s = time.monotonic() - started
        self.coordinator.restart(resume_after=t_fail, persisted_steps={})
        return {
            "resume_after": resume_after,
            "start_step": t_fail + 1,
            "plan_s": plan_s,
            "load_s": load_s,
            "replay_s": replay_s,
            "drain_s": drain_s,
            "replay_max_loss_diff": replay_diff,
        }

    def finish(self) -> tuple[int, int]:
        self._drain()
        if self.writer is None:
            return self.bytes_written, len(self.tags)  # rank 0 counted every rank's files
        self.writer.close()
        written = self.train_engine.engine.checkpoint_engine.bytes_written  # this rank's files
        self.train_engine.engine.checkpoint_engine = self._saved_engine
        return written, len(self.tags)


class Differential:
    """Every layer every ``interval`` steps through LayerCheck's own path (the ``interval``
    policy), plus a top-k delta of every layer's state each step in between; recovery loads the
    composite (LayerCheck's recovery) and replays the deltas since.

    The delta is encoded on the training thread where the optimizer state lives (on the GPU
    there, as gradient compression would be), so its cost is stall; only the small indices and
    values go to host memory and the writer thread."""

    def __init__(
        self, train_engine: TrainEngine, strategy: Strategy, root: Path, coordinator: LocalCoordinator
    ) -> None:
        self.train_engine, self.coordinator = train_engine, coordinator
        self.encoder = deltas.DeltaEncoder(strategy.delta_density)
        self.delta_root = root / "deltas"
        self.delta_root.mkdir(parents=True, exist_ok=True)
        self.rank = torch.distributed.get_rank()
        self.names = tuple(train_engine.layer_map.names)
        self.writer = JobThread(f"delta-writer-{self.rank}")
        self.last_full: int | None = None
        self.persisted: dict[int, tuple[str, ...]] = {}
        self.stall_s = 0.0
        self.delta_bytes = 0
        self.events = 0

    def _device_state(self) -> dict[tuple[str, str], torch.Tensor]:
        """This rank's owned state of every layer as flat tensors, in ``snapshot_layers`` order."""
        out = {}
        for name in self.names:
            owned = self.train_engine.layout[name].owned
            for key in STATE_KEYS:
                views = [state_view(self.train_engine.layout.optimizer, piece, key) for piece in owned]
                out[(name, key)] = torch.cat(views) if views else torch.empty(0)
        return out

    def after_step(self, step: int) -> None:
        started = time.monotonic()
        handed = self.coordinator.handed
        if handed and handed[-1][0] == step:  # the loop just handed a full version taken now
            self.encoder.reset_tensors(self._device_state())
            self.last_full = step
        elif self.last_full is not None:
            encoded = self.encoder.encode_tensors(self._device_state())
            self.writer.submit(lambda: self._write_delta(step, encoded))
            self.events += 1
        if self.last_full is not None:
            self.persisted[step] = self.names
        self.stall_s += time.monotonic() - started

    def _write_delta(self, step: int, encoded: dict[str, torch.Tensor]) -> None:
        self.delta_bytes += deltas.write_delta(self.delta_root, step, self.rank, encoded)

    def recover(self, t_fail: int) -> dict[str, Any]:
        started = time.monotonic()
        self.writer.drain()
        delta_drain_s = time.monotonic() - started
        recovered = recover(self.train_engine, self.coordinator)
        if recovered.records is None:
            raise RuntimeError("differential: a failure before the first full checkpoint")
        full_step = max(recovered.versions.values())
        started = time.monotonic()
        shards = snapshot_layers(self.train_engine.layout, self.names, HostBufferPool(), step=t_fail)
        deltas.replay(shards, self.delta_root, range(full_step + 1, t_fail + 1), self.rank)
        for shard in shards:
            shard.optimizer_step = t_fail  # every layer's Adam took a step at every step
        restore_from_shards(self.train_engine.layout, shards)
        self.encoder.reset_tensors(self._device_state())
        replay_s = time.monotonic() - started
        seek_step(self.train_engine, t_fail)
        return {
            "resume_after": t_fail,
            "start_step": t_fail + 1,
            "plan_s": recovered.plan_s,
            "load_s": recovered.load_s,
            "replay_s": replay_s,
            "drain_s": delta_drain_s + recovered.drain_s,
            "versions": {name: t_fail for name in self.names},
        }

    def finish(self) -> tuple[int, int]:
        self.writer.drain()
        self.writer.close()
        return self.delta_bytes, self.events


def make_baseline(
    train_engine: TrainEngine,
    strategy: Strategy,
    root: Path,
    coordinator: LocalCoordinator,
    *,
    batches: Callable[[int], list[torch.Tensor]],
    losses: Callable[[], dict[int, float]],
    reset: Callable[[], None],
) -> DeepSpeedFull | DCPFull | Differential | None:
    """The strategy's own checkpointing, or ``None`` where LayerCheck's path is all of it. A
    rollback needs the batches of a step, the losses recorded so far and a reset to the initial weights."""
    if strategy.kind in (Kind.DEEPSPEED_SYNC, Kind.DEEPSPEED_ASYNC):
        if train_engine.adapter.kind != "deepspeed":
            raise ValueError(
                f"strategy {strategy.name}: DeepSpeed's save_checkpoint needs the DeepSpeed engine, not "
                f"{train_engine.adapter.describe()} (under --engine fsdp2 the baselines are dcp and dcp-async)"
            )
        return DeepSpeedFull(train_engine, strategy, root, coordinator, batches=batches, losses=losses, reset=reset)
    if strategy.kind in (Kind.DCP_SYNC, Kind.DCP_ASYNC):
        return DCPFull(train_engine, strategy, root, coordinator, batches=batches, losses=losses, reset=reset)
    if strategy.kind is Kind.DIFFERENTIAL:
        return Differential(train_engine, strategy, root, coordinator)
    return None


def host_copy(value: Any) -> Any:
    """A deep copy of a state dict whose tensors are cloned into host memory."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: host_copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [host_copy(v) for v in value]
    if isinstance(value, tuple):
        return tuple(host_copy(v) for v in value)
    return value


def async_checkpoint_engine(writer: JobThread) -> Any:
    """A DeepSpeed checkpoint engine that writes ``torch.save`` files from ``writer``'s thread
    (atomically: temporary name, then rename). Its ``save`` returns once the state is copied."""
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    class AsyncDeepSpeedCheckpointEngine(TorchCheckpointEngine):
        def __init__(self) -> None:
            super().__init__(None)
            self.bytes_written = 0

        def save(self, state_dict: Any, path: str) -> None:
            copied = host_copy(state_dict)

            def write() -> None:
                tmp = f"{path}.tmp"
                torch.save(copied, tmp)
                os.replace(tmp, path)
                self.bytes_written += os.path.getsize(path)

            writer.submit(write)

    return AsyncDeepSpeedCheckpointEngine()


def tree_bytes(path: Path) -> int:
    """Total size of the files under ``path``."""
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
