"""Rank 0's committer: takes every rank's shard receipts from the :class:`Mailbox` and commits a
version once all its shards are in — the same :class:`CommitTracker` and ``LayerStore.commit``
as the Ray supervisor's commit path, on a thread of rank 0 instead of an actor.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

from orchestrator.core.commit_tracker import CommitTracker
from orchestrator.local.mailbox import Mailbox
from orchestrator.store.layer_store import LayerStore
from orchestrator.store.manifest import ShardReceipt

logger = logging.getLogger(__name__)


@dataclass
class CommitLog:
    committed: list[tuple[str, int]] = field(default_factory=list)
    """(layer, step) of every committed version, in commit order."""
    committed_bytes: int = 0
    failures: int = 0


class Committer:
    def __init__(self, store: LayerStore, mailbox: Mailbox) -> None:
        self.store = store
        self.tracker = CommitTracker()
        self.log = CommitLog()
        self._mailbox = mailbox.client()
        self._poster = mailbox.client()  # the reader's client may be blocked in a pop
        self._taken = 0
        self._changed = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="layercheck-committer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            try:
                data = self._mailbox.take()
            except Exception as error:  # the store's timeout with nothing to take: keep listening
                logger.debug("mailbox: %s", error)
                continue
            if data is None:
                return
            self._handle(ShardReceipt.from_json(data))
            with self._changed:
                self._taken += 1
                self._changed.notify_all()

    def _handle(self, receipt: ShardReceipt) -> None:
        with self._changed:
            complete = self.tracker.add(receipt)
        if complete is None:
            return
        try:
            record = self.store.commit(complete)
        except Exception as error:  # storage trouble: keep training, keep what is committed
            with self._changed:
                self.log.failures += 1
            logger.error("commit of %s step %d failed: %s", receipt.layer, receipt.step, error)
            return
        with self._changed:
            self.tracker.committed(record.layer, record.step)
            self.log.committed.append((record.layer, record.step))
            self.log.committed_bytes += record.nbytes

    def catch_up(self, timeout_s: float) -> bool:
        """Wait until every receipt posted so far is handled (call once every writer is drained);
        False at the deadline."""
        posted = self._poster.posted()
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while self._taken < posted:
                left = deadline - time.monotonic()
                if left <= 0:
                    logger.error("committer behind after %.0fs: %d of %d receipts handled", timeout_s,
                                 self._taken, posted)
                    return False
                self._changed.wait(left)
        return True

    def forget_incomplete(self) -> int:
        """A failure: versions not whole by now never will be."""
        with self._changed:
            return self.tracker.forget_incomplete()

    def close(self) -> None:
        self._poster.stop()
        self._thread.join()
