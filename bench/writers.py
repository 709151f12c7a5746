"""Off-the-critical-path writers the harness uses, one background thread per rank.

* :class:`BackgroundWriter`: runs submitted jobs in order on a thread; a bounded queue gives
  back-pressure (training waits when storage falls behind, and that wait is counted as stall);
  a job's error is kept and raised at :meth:`drain`, never lost, never killing the trainer.
* :class:`LayerStoreWriter`: writes this rank's shard of each version through
  ``LayerStore.write_shard``, publishes the receipt as a small JSON file, and on rank 0 waits
  for every rank's receipt and commits (``LayerStore.commit``) — the protocol of the real
  persistence pool, with files instead of Ray messages.
* :class:`AsyncDeepSpeedCheckpointEngine`: DeepSpeed's own ``save_checkpoint`` with a checkpoint
  engine whose ``save`` copies the state dict to host memory and writes it from the thread:
  the same files as the synchronous baseline, written off the critical path.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from orchestrator.store.manifest import ShardReceipt
from orchestrator.store.layer_store import LayerStore
from workers.host_buffers import HostBufferPool
from workers.shard import LayerShard

logger = logging.getLogger(__name__)


class BackgroundWriter:
    """Jobs run in submission order on one thread."""

    def __init__(self, name: str, max_pending: int = 8) -> None:
        self._queue: queue.Queue[Callable[[], None] | None] = queue.Queue(maxsize=max_pending)
        self._errors: list[BaseException] = []
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        self._closed = False

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            try:
                if job is None:
                    return
                job()
            except BaseException as error:  # kept for drain(); the thread carries on
                logger.exception("background write failed")
                self._errors.append(error)
            finally:
                self._queue.task_done()

    def submit(self, job: Callable[[], None]) -> None:
        """Queue ``job``; blocks while ``max_pending`` jobs wait (storage back-pressure)."""
        self._queue.put(job)

    def drain(self) -> None:
        """Wait until every submitted job has run; raise the first error any of them raised."""
        self._queue.join()
        if self._errors:
            raise RuntimeError(f"{len(self._errors)} background write(s) failed") from self._errors[0]

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._queue.put(None)
            self._thread.join()


class LayerStoreWriter:
    """Writes and commits layer versions through the LayerStore from a background thread."""

    def __init__(self, store: LayerStore, receipts_dir: Path, *, rank: int, world_size: int,
                 pool: HostBufferPool, commit_timeout_s: float = 300.0) -> None:
        self.store = store
        self.receipts_dir = receipts_dir
        self.rank = rank
        self.world_size = world_size
        self.pool = pool
        self.commit_timeout_s = commit_timeout_s
        self.bytes_written = 0
        self.versions_committed = 0
        receipts_dir.mkdir(parents=True, exist_ok=True)

    def write(self, shards: Sequence[LayerShard], *, base: bool) -> None:
        """Write (and on rank 0 commit) ``shards``; releases their buffers. Runs on the thread."""
        receipts = []
        try:
            for shard in shards:
                receipt = self.store.write_shard(shard, base=base)
                self.bytes_written += receipt.nbytes
                self._publish(receipt)
                receipts.append(receipt)
        finally:
            for shard in shards:
                self.pool.release(shard)
        if self.rank == 0:
            for receipt in receipts:
                self.store.commit(self._gather(receipt))
                self.versions_committed += 1

    def _name(self, layer: str, step: int, base: bool, rank: int) -> Path:
        return self.receipts_dir / f"{layer}@{step:010d}{'-base' if base else ''}.rank{rank}.json"

    def _publish(self, receipt: ShardReceipt) -> None:
        final = self._name(receipt.layer, receipt.step, receipt.base, receipt.rank)
        tmp = final.with_suffix(".tmp")
        tmp.write_text(json.dumps(receipt.to_json()))
        os.replace(tmp, final)

    def _gather(self, mine: ShardReceipt) -> list[ShardReceipt]:
        deadline = time.monotonic() + self.commit_timeout_s
        out = []
        for rank in range(self.world_size):
            path = self._name(mine.layer, mine.step, mine.base, rank)
            while not path.exists():
                if time.monotonic() > deadline:
                    raise TimeoutError(f"rank {rank}'s receipt for {mine.layer}@{mine.step} never came ({path})")
                time.sleep(0.002)
            out.append(ShardReceipt(**json.loads(path.read_text())))
        return out


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


def async_checkpoint_engine(writer: BackgroundWriter) -> Any:
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
