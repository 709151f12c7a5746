"""The in-memory mailbox between every rank's writer and rank 0's :class:`RunSupervisor`: a
``torch.distributed.TCPStore`` hosted by rank 0 beside the rendezvous. Nothing touches storage.

Two things travel through it:

* **messages** (a queue): each written shard's receipt with its write time, and each failed
  write; rank 0's :class:`~layercheck.orchestrator.local.receipts.ReceiptPump` takes them. ``posted``
  counts the messages sent, so rank 0 can tell when it has taken them all.
* **drain answers** (one key per rank and drain round): a rank whose writer finished what it
  held (or ran out of time) says so; rank 0's writers port waits for every rank's answer.

Every thread that talks to the store uses its own client (:meth:`Mailbox.client`), as the store
requires.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch.distributed as dist

logger = logging.getLogger(__name__)

QUEUE = "receipts"
POSTED = "receipts/posted"
STOP = "stop"
RECEIPT = "receipt"
WRITE_FAILED = "write_failed"


class Mailbox:
    """One client of the run's mailbox."""

    def __init__(self, store: dist.Store) -> None:
        self._store = store

    @classmethod
    def create(cls, *, timeout_s: float = 300.0) -> Mailbox:
        """Rank 0 hosts the store on a free port and tells the others (a collective)."""
        rank = dist.get_rank()
        host = os.environ.get("MASTER_ADDR", "127.0.0.1")
        timeout = datetime.timedelta(seconds=timeout_s)
        store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=timeout) if rank == 0 else None
        box = [store.port if store is not None else 0]
        dist.broadcast_object_list(box, src=0)
        if store is None:
            store = dist.TCPStore(host, int(box[0]), is_master=False, timeout=timeout)
        return cls(store)

    def client(self) -> Mailbox:
        """A client for another thread."""
        # torch's stubs omit Store.clone, which c10d binds
        return Mailbox(self._store.clone())  # type: ignore[attr-defined]

    # ---- messages -------------------------------------------------------------------------
    def post(self, receipt: Mapping[str, object], write_s: float) -> None:
        """A shard was written in ``write_s`` seconds; ``receipt`` is its ``ShardReceipt.to_json()``."""
        self._push({"kind": RECEIPT, "receipt": dict(receipt), "write_s": write_s})

    def post_failure(self, what: str, *, layer: str, step: int) -> None:
        """A shard of ``layer`` at ``step`` could not be written (``what`` says which and why)."""
        self._push({"kind": WRITE_FAILED, "what": what, "layer": layer, "step": step})

    def _push(self, message: Mapping[str, object]) -> None:
        self._store.queue_push(QUEUE, json.dumps(dict(message)))
        self._store.add(POSTED, 1)

    def stop(self) -> None:
        """Wake the reader and tell it to end."""
        self._store.queue_push(QUEUE, STOP)

    def take(self) -> dict[str, Any] | None:
        """The next message (blocks up to the store's timeout); ``None`` once told to stop."""
        value = self._store.queue_pop(QUEUE).decode()
        return None if value == STOP else json.loads(value)

    def posted(self) -> int:
        """Messages posted so far, by every rank."""
        return int(self._store.add(POSTED, 0))

    # ---- drain answers --------------------------------------------------------------------
    def say_drained(self, round_: int, rank: int, ok: bool) -> None:
        """Rank ``rank``'s writer finished what it held in drain ``round_`` (``ok``) or ran out of time."""
        self._store.set(_drained_key(round_, rank), "1" if ok else "0")

    def await_drained(self, round_: int, ranks: Sequence[int], timeout_s: float) -> dict[int, bool]:
        """Each rank's answer to drain ``round_``, waiting up to ``timeout_s`` in all; a rank
        that has not answered by then counts as not drained."""
        deadline = time.monotonic() + timeout_s
        answers: dict[int, bool] = {}
        for rank in ranks:
            key = _drained_key(round_, rank)
            left = max(0.001, deadline - time.monotonic())
            try:
                self._store.wait([key], datetime.timedelta(seconds=left))
            except Exception as error:  # the store's timeout: this rank never answered
                logger.debug("drain %d: no answer from rank %d: %s", round_, rank, error)
                answers[rank] = False
                continue
            answers[rank] = self._store.get(key).decode() == "1"
        return answers


def _drained_key(round_: int, rank: int) -> str:
    return f"drained/{round_}/{rank}"
