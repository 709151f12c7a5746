"""A run that cannot start is not a run that failed: end it at once, with its cause.

Ray Train retries every worker-group error up to ``FailureConfig(max_failures)``. For an error
raised before the run's first training step — a DeepSpeed config whose batch sizes disagree, a
model that does not build, a bug in the loop's setup — each retry does the same work and fails the
same way (three retries: 97 s for one assertion, and a summary of empty recoveries). So Ray Train's
controller asks :class:`SetupErrorsEndTheRun` about every worker error: while no step of the run has
been trained (the supervisor's account), an error that a worker *raised* — not a worker that died,
nor a collective broken by a peer that died — is a setup error, and the run ends with it, not
retried. Once training began, every failure is LayerCheck's to recover; so is a load that found a
version of its composite corrupt (a ``--resume`` whose newest version of a layer has a damaged
tensor): the rank reported the version before it raised, and the retry's plan skips it
(``RunSupervisor.worth_retrying``), as a live recovery's does.

A supervisor found dead here ends the run too (:class:`SupervisorLost`): a new group could not
join it, so every retry would fail the same way (``supervisor_loss.py``).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import ray

from layercheck.orchestrator.runtime.callback_base import user_callback_base
from layercheck.orchestrator.runtime.handles import SupervisorHandle
from layercheck.orchestrator.runtime.policy_actor import PolicyActorLost
from layercheck.orchestrator.runtime.supervisor_loss import SupervisorLost, lost_reason, supervisor_died

logger = logging.getLogger(__name__)

#: Messages of errors a collective raises when a peer is gone (gloo, NCCL, torch's store).
_PEER_GONE = ("connection closed by peer", "connection reset", "broken pipe", "nccl", "gloo", "timed out", "timeout")
#: Known setup errors and what fixes them (a substring of the error's text → the fix).
_FIXES = {
    "train_batch_size is not equal to": (
        "DeepSpeed needs train_batch_size = train_micro_batch_size_per_gpu x gradient_accumulation_steps x "
        'world size: set them so, or give only two of them (with the Hugging Face Trainer: "auto")'
    ),
}


class SetupError(RuntimeError):
    """A worker raised before the run's first training step: the run ends, not retried."""


def peer_gone(error: BaseException) -> bool:
    """``error`` says a process went away (the worker itself, or a peer of its collective)
    rather than what the worker's own code did wrong."""
    if isinstance(error, (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError, PolicyActorLost)):
        return True  # (the policy actor's process: it is rebuilt, and the group recovered)
    try:
        import torch.distributed

        if isinstance(error, torch.distributed.DistError):
            return True
    except (ImportError, AttributeError):  # pragma: no cover - torch without distributed
        pass
    text = f"{type(error).__name__}: {error}".lower()
    return any(marker in text for marker in _PEER_GONE)


def setup_failure(worker_exceptions: Mapping[int, BaseException]) -> str | None:
    """What to tell the user if ``worker_exceptions`` (rank → error, all raised before any step)
    are a setup error; ``None`` if any worker died or only collectives broke (a real failure)."""
    if not worker_exceptions or any(peer_gone(e) for e in worker_exceptions.values()):
        return None
    rank, error = min(worker_exceptions.items())
    text = f"{type(error).__name__}: {error}".strip()
    fix = next((fix for marker, fix in _FIXES.items() if marker in text), None)
    ranks = sorted(worker_exceptions)
    return (
        f"rank {rank} failed before the first training step, so the run ends (a setup error is not "
        f"retried; ranks that raised: {ranks}): {text}" + (f"\nFix: {fix}" if fix else "")
    )


class SetupErrorsEndTheRun(user_callback_base()):  # type: ignore[misc]
    """Runs in Ray Train's controller: raising from its hook makes the worker errors a
    non-retryable controller error, so ``fit`` ends with :class:`SetupError` (or
    :class:`SupervisorLost`, when the supervisor is dead)."""

    def __init__(self, supervisor: SupervisorHandle) -> None:
        self.supervisor = supervisor

    def after_exception(self, run_context: object, worker_exceptions: dict[int, Exception]) -> None:
        try:
            retry = bool(ray.get(self.supervisor.worth_retrying.remote(), timeout=10))
        except Exception as error:  # noqa: BLE001 - unknown: leave it to Ray Train's retries
            if supervisor_died(error):  # no new group could join it: end the run, do not retry
                lost = lost_reason(None)
                logger.error("LAYERCHECK: %s", lost)
                raise SupervisorLost(lost) from None
            logger.warning("cannot ask the supervisor whether a retry would differ (%s): Ray Train retries", error)
            return
        if retry:
            return
        message = setup_failure(worker_exceptions)
        if message is None:
            return
        logger.error("LAYERCHECK: %s", message)
        self.supervisor.setup_failed.remote(message)
        raise SetupError(message)
