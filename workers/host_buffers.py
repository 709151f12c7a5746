"""Reusable host buffers for layer snapshots.

A snapshot copies a layer's shard from the device into host memory and hands it to the
persistence pool; the buffers come back at once where the hand-over copies them on the training
thread (:meth:`HostBufferPool.release`), else from whoever keeps the shard once done with it
(:meth:`HostBufferPool.give`, then :meth:`HostBufferPool.recycle`): the local writer after its
write, a Ray rank's putting thread once the shard is in the object store. Reusing them keeps
steady-state snapshots allocation-free (a fresh buffer of a few MB costs its page faults on the
training thread: about 3x its copy), and page-locked (pinned) where CUDA is present so the
device-to-host copy runs at full speed. Without CUDA pinning buys nothing and is skipped.
"""

from __future__ import annotations

import logging
import threading
import weakref

import torch

from layercheck.workers.shard import LayerShard

logger = logging.getLogger(__name__)


class HostBufferPool:
    """Flat float32 host buffers, recycled by size. Thread-safe: release may come from a writer thread."""

    def __init__(self, pin: bool | None = None) -> None:
        self.pin = torch.cuda.is_available() if pin is None else pin
        self._free: dict[int, list[torch.Tensor]] = {}
        self._lent: dict[int, torch.Tensor] = {}
        # given away and not yet recycled; weak: a holder that drops a shard instead leaks nothing
        self._given: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()
        self._lock = threading.Lock()
        self.allocated_bytes = 0

    def acquire(self, numel: int) -> torch.Tensor:
        """A buffer of ``numel`` float32 elements (contents undefined)."""
        with self._lock:
            free = self._free.get(numel)
            buffer = free.pop() if free else None
            if buffer is None:
                buffer = torch.empty(numel, dtype=torch.float32, pin_memory=self.pin)
                self.allocated_bytes += buffer.numel() * buffer.element_size()
            self._lent[id(buffer)] = buffer
            return buffer

    def release(self, shard: LayerShard) -> None:
        """Return ``shard``'s buffers for reuse; the shard must not be read afterwards."""
        with self._lock:
            for tensor in shard.tensors.values():
                buffer = self._lent.pop(id(tensor), None)
                if buffer is not None:  # tensors this pool did not lend are left alone
                    self._free.setdefault(buffer.numel(), []).append(buffer)

    def give(self, shard: LayerShard) -> None:
        """``shard``'s buffers leave the pool: whoever holds the shard keeps them (the pool takes new
        ones) until it hands them back with :meth:`recycle`. Pinned buffers are costly to make: only
        a holder that hands them back within moments should keep them
        (:class:`~layercheck.workers.coordinator.KeepsHostBuffers`)."""
        with self._lock:
            for tensor in shard.tensors.values():
                buffer = self._lent.pop(id(tensor), None)
                if buffer is not None:
                    self.allocated_bytes -= buffer.numel() * buffer.element_size()
                    self._given[id(buffer)] = buffer

    def recycle(self, shard: LayerShard) -> None:
        """Take back the buffers of a shard :meth:`give` let go, once its holder is done with it
        (the writer, after its write); the shard must not be read afterwards. Thread-safe; the
        tensors of a shard this pool did not give are left alone."""
        with self._lock:
            for tensor in shard.tensors.values():
                buffer = self._given.pop(id(tensor), None)
                if buffer is tensor:
                    self._free.setdefault(buffer.numel(), []).append(buffer)
                    self.allocated_bytes += buffer.numel() * buffer.element_size()

    @property
    def lent(self) -> int:
        """How many buffers are out (a growing number means shards are never released)."""
        with self._lock:
            return len(self._lent)
