"""Holding Ray Train's teardown of a broken worker group until its survivors have handed over
their state (:mod:`layercheck.workers.capture`, :mod:`layercheck.orchestrator.core.recovery.capture_window`).

Ray Train v2 restarts a group whose worker died by shutting the whole group down
(``WorkerGroup.shutdown``: its callbacks' ``before_worker_group_shutdown``, then each worker's
``shutdown`` and ``ray.kill``). :class:`CaptureHold` is such a callback, run in Ray Train's
controller: when the group's last poll shows failed ranks, it asks the supervisor to wait for the
other ranks' captures (bounded by ``persistence.capture_grace_s`` / ``capture_timeout_s``) before
the teardown goes on. A group that ends normally (no failed rank) is not held.

With NCCL a survivor sits in a collective that returns only at its timeout instead of raising,
and would never begin a capture. So before it waits, the hold asks every survivor's process to
release itself (:func:`layercheck.workers.collective_abort.request_abort`, run in the worker actor beside its
training thread): an NCCL rank aborts its process groups, its collective returns, its step raises
and it captures; a gloo rank has raised already or will by itself, and does nothing. What each
survivor decided is logged. A survivor that still never begins is given up on after the grace period.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import ray
from ray.train.v2._internal.execution.callback import WorkerGroupCallback

from layercheck.orchestrator.runtime.handles import SupervisorHandle
from layercheck.workers.collective_abort import request_abort

if TYPE_CHECKING:
    from ray.train.v2._internal.execution.worker_group import WorkerGroup

logger = logging.getLogger(__name__)

#: Slack over the supervisor's own bound before the controller stops waiting for its answer.
ANSWER_SLACK_S = 10.0
#: How long the hold waits for the survivors' answers to the abort request before it waits for captures.
ANSWER_WAIT_S = 2.0


class CaptureHold(WorkerGroupCallback):
    def __init__(self, supervisor: SupervisorHandle, bound_s: float = 60.0) -> None:
        self.supervisor = supervisor
        self.bound_s = bound_s

    def before_worker_group_shutdown(self, worker_group: WorkerGroup) -> None:
        try:
            self._hold(worker_group)
        except Exception as error:  # noqa: BLE001 - never stand in the way of Ray Train's restart
            logger.warning("LayerCheck: could not hold the teardown for survivors' captures: %r", error)

    def _hold(self, worker_group: WorkerGroup) -> None:
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
        released = _answers(self._release(worker_group, survivors, failed))
        outcome = ray.get(
            self.supervisor.await_captures.remote(survivors, teardown_at, sorted(failed), released),
            timeout=self.bound_s + ANSWER_SLACK_S,
        )
        logger.info(
            "LayerCheck held the teardown %.2fs: ranks %s captured, %s did not; asked to abort a blocked "
            "collective, ranks answered %s",
            outcome.hold_s,
            list(outcome.captured),
            list(outcome.missed),
            released,
        )

    @staticmethod
    def _release(worker_group: WorkerGroup, survivors: list[int], failed: set[int]) -> dict[int, Any]:
        """Ask each survivor to abort a collective blocked on the failed ranks; per rank, the
        reference of its answer."""
        reason = f"Ray Train saw rank(s) {sorted(failed)} fail"
        asked = {}
        for rank in survivors:
            try:
                asked[rank] = worker_group.execute_single_async(rank, request_abort, reason)
            except Exception as error:  # noqa: BLE001 - that rank simply is not released
                logger.warning("LayerCheck: could not ask rank %d to abort its collectives: %r", rank, error)
        return asked


def _answers(asked: dict[int, Any]) -> dict[int, str]:
    """The survivors' answers (each a quick call beside the training thread), waited for at most
    ``ANSWER_WAIT_S``: an unanswered one is ``"no answer"``, and its capture is waited for all the same."""
    refs = list(asked.values())
    ready = set(ray.wait(refs, num_returns=len(refs), timeout=ANSWER_WAIT_S)[0]) if refs else set()
    out = {}
    for rank, ref in asked.items():
        try:
            out[rank] = ray.get(ref) if ref in ready else "no answer"
        except Exception as error:  # noqa: BLE001 - a survivor that died meanwhile
            out[rank] = f"failed: {type(error).__name__}"
    return out
