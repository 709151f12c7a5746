"""Holding Ray Train's teardown of a broken worker group until its survivors have handed over
their state (:mod:`workers.capture`, :mod:`orchestrator.core.capture_window`).

Ray Train v2 restarts a group whose worker died by shutting the whole group down
(``WorkerGroup.shutdown``: its callbacks' ``before_worker_group_shutdown``, then each worker's
``shutdown`` and ``ray.kill``). :class:`CaptureHold` is such a callback, run in Ray Train's
controller: when the group's last poll shows failed ranks, it asks the supervisor to wait for the
other ranks' captures (bounded by ``persistence.capture_grace_s`` / ``capture_timeout_s``) before
the teardown goes on. A group that ends normally (no failed rank) is not held.

With NCCL a survivor may sit in a collective that never returns instead of raising: it never
begins a capture, so the hold gives up on it after the grace period. (Aborting its communicator
from here, so that it raises and captures, is the GPU path the design describes; not built yet.)
"""

from __future__ import annotations

import logging
import time
from typing import Any

import ray
from ray.train.v2._internal.execution.callback import WorkerGroupCallback

logger = logging.getLogger(__name__)

#: Slack over the supervisor's own bound before the controller stops waiting for its answer.
ANSWER_SLACK_S = 10.0


class CaptureHold(WorkerGroupCallback):
    def __init__(self, supervisor: Any, bound_s: float = 60.0) -> None:
        self.supervisor = supervisor
        self.bound_s = bound_s

    def before_worker_group_shutdown(self, worker_group: Any) -> None:
        try:
            self._hold(worker_group)
        except Exception as error:  # noqa: BLE001 - never stand in the way of Ray Train's restart
            logger.warning("LayerCheck: could not hold the teardown for survivors' captures: %r", error)

    def _hold(self, worker_group: Any) -> None:
        status = worker_group.get_latest_poll_status()
        if status is None:
            return
        failed = set(status.errors)
        if not failed:
            return  # a normal end, or a resize: nothing broke under anyone
        # a survivor that handed its capture over raises afterwards, so it may already count as failed:
        # the supervisor waits for every rank that began a capture, failed or not
        survivors = sorted(rank for rank in status.worker_statuses if rank not in failed)
        teardown_at = time.time()
        outcome = ray.get(
            self.supervisor.await_captures.remote(survivors, teardown_at, sorted(failed)),
            timeout=self.bound_s + ANSWER_SLACK_S,
        )
        logger.info(
            "LayerCheck held the teardown %.2fs: ranks %s captured, %s did not",
            outcome["hold_s"],
            outcome["captured"],
            outcome["missed"],
        )
