"""Rank 0's receipt pump: a thread that takes every rank's messages from the :class:`Mailbox`
and feeds them to the run's :class:`RunSupervisor` — a receipt to ``shard_written`` (which
commits a whole version, retrying, or counts it lost: the Ray runtime's commit path), a failed
write to ``write_failed``. It is the local counterpart of the writer actors' calls to the Ray
``SupervisorActor``; it decides nothing itself.
"""

from __future__ import annotations

import logging
import threading
import time

from layercheck.orchestrator.core.run_supervisor import RunSupervisor
from layercheck.orchestrator.local.mailbox import RECEIPT, WRITE_FAILED, Mailbox
from layercheck.orchestrator.store.manifest import ShardReceipt

logger = logging.getLogger(__name__)


class ReceiptPump:
    def __init__(self, mailbox: Mailbox, run: RunSupervisor) -> None:
        self.run = run
        self._mailbox = mailbox.client()
        self._poster = mailbox.client()  # the reader's client may be blocked in a pop
        self._taken = 0
        self._changed = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="layercheck-receipts", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            try:
                message = self._mailbox.take()
            except Exception as error:  # the store's timeout with nothing to take: keep listening
                logger.debug("mailbox: %s", error)
                continue
            if message is None:
                return
            try:
                self._handle(message)
            except Exception:  # a bug here must not stop the commits of later receipts
                logger.exception("handling %s failed", message.get("kind"))
            with self._changed:
                self._taken += 1
                self._changed.notify_all()

    def _handle(self, message: dict) -> None:
        if message["kind"] == RECEIPT:
            self.run.shard_written(ShardReceipt.from_json(message["receipt"]), float(message["write_s"]))
        elif message["kind"] == WRITE_FAILED:
            self.run.write_failed(message["layer"], int(message["step"]))
        else:
            logger.error("mailbox: unknown message %r", message)

    def catch_up(self, timeout_s: float) -> bool:
        """Wait until every message posted so far is handled (its commit, with retries, done);
        False at the deadline."""
        posted = self._poster.posted()
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while self._taken < posted:
                left = deadline - time.monotonic()
                if left <= 0:
                    logger.error("receipts behind after %.0fs: %d of %d handled", timeout_s, self._taken, posted)
                    return False
                self._changed.wait(left)
        return True

    def close(self) -> None:
        self._poster.stop()
        self._thread.join()
