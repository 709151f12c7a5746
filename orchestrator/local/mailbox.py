"""The in-memory mailbox that carries shard receipts from every rank's writer to rank 0's
committer: a ``torch.distributed.TCPStore`` hosted by rank 0 beside the rendezvous, used as a
queue. Nothing touches storage; a receipt is a few hundred bytes of JSON.

Every thread that talks to the store uses its own client (:meth:`Mailbox.client`), as the store
requires; ``posted`` counts receipts sent so rank 0 can tell when it has seen them all.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
from collections.abc import Mapping
from typing import Any

import torch.distributed as dist

logger = logging.getLogger(__name__)

QUEUE = "receipts"
POSTED = "receipts/posted"
STOP = "stop"


class Mailbox:
    """One client of the run's receipt queue."""

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
        return Mailbox(self._store.clone())

    def post(self, receipt: Mapping[str, Any]) -> None:
        self._store.queue_push(QUEUE, json.dumps(dict(receipt)))
        self._store.add(POSTED, 1)

    def stop(self) -> None:
        """Wake the reader and tell it to end."""
        self._store.queue_push(QUEUE, STOP)

    def take(self) -> dict[str, Any] | None:
        """The next receipt (blocks up to the store's timeout); ``None`` once told to stop."""
        value = self._store.queue_pop(QUEUE).decode()
        return None if value == STOP else json.loads(value)

    def posted(self) -> int:
        """Receipts posted so far, by every rank."""
        return int(self._store.add(POSTED, 0))


