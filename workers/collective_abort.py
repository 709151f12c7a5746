"""Releasing a survivor blocked in a collective, so that it can hand over its capture.

When a peer dies, a gloo survivor's next collective raises on its own (the peer's connection
closes: 50-80 ms after the death), and :meth:`layercheck.workers.loop.StepProtocol.on_failure` captures.
An NCCL survivor does not: its collective is a kernel spinning on the GPU, waiting for a peer
that will never send, and the host thread waits behind it until NCCL's watchdog times out (the
process group's timeout: Ray Train's ``TorchConfig.timeout_s``, 1800 s by default) — long after
Ray Train has torn the group down. Whoever knows of the death first (Ray Train's controller,
through :mod:`layercheck.orchestrator.runtime.capture_hold`) asks this process to :meth:`CollectiveAbort.request`
an abort: every process group is aborted (``ncclCommAbort`` under torch's
``_abort_process_group``), the spinning kernels return, the training thread's next collective
raises, and the capture runs as on gloo.

What to do is a value (:class:`AbortDecision`, from :func:`decide`); only ``ABORT`` touches
torch. On gloo the answer is ``NOT_NEEDED``: gloo raises by itself, and in torch 2.13 a gloo
group's ``abort()`` does not release a collective in flight anyway (measured: a blocked
``all_reduce`` returned only when its peer went away, abort or not), so nothing is called.

A failed NCCL collective does not raise where it ran: its output is whatever the aborted kernel
left, and work queued after it (an optimizer update) may consume that. So on such a backend a
capture is trusted only where the optimizer has not stepped since the rank's last completed step
(:attr:`CollectiveAbort.synchronous_errors`, used by :func:`layercheck.workers.capture.refusal`).

A rank told of the loss may also be waiting outside any collective, for the policy's decision on
the step before (:data:`layercheck.workers.loop.DECISION_LAG`): a decision that never comes when
the lost peer's report of that step died with it. No collective fails there, on any backend, and
in place nothing tears the rank down. So every request while training is remembered
(:func:`peer_lost`), and that wait raises :class:`PeerLost` when it sees one.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)


class PeerLost(RuntimeError):
    """A rank was told that a peer of its group is gone while it waited outside any collective
    (for a decision that needed the peer's report): what its step would have raised."""


class AbortDecision(enum.Enum):
    ABORT = "abort"
    """Training, not yet raised, on a backend whose blocked collectives wait for a timeout: abort."""
    NOT_NEEDED = "not_needed"
    """The backend's collectives raise by themselves when a peer goes away (gloo)."""
    ALREADY_RAISED = "already_raised"
    """The training thread has control back already (it is capturing, or done)."""
    ALREADY_ABORTED = "already_aborted"
    NOT_TRAINING = "not_training"
    """Before the per-step protocol began or after it finished: no state fresher than storage."""
    NO_WATCHER = "no_watcher"
    """This process has no :class:`CollectiveAbort` installed (capture is off, or not a LayerCheck rank)."""


def raises_by_itself(backend: str) -> bool:
    """Whether a collective of ``backend`` raises when a peer dies (``torch.distributed.get_backend()``
    names, e.g. ``"gloo"``, ``"nccl"``, ``"cpu:gloo,cuda:nccl"``): gloo's do, NCCL's wait."""
    return "nccl" not in backend.lower()


def decide(*, backend: str, training: bool, raised: bool, aborted: bool) -> AbortDecision:
    """What to do when told that a peer of this rank's group is gone."""
    if aborted:
        return AbortDecision.ALREADY_ABORTED
    if raised:
        return AbortDecision.ALREADY_RAISED
    if not training:
        return AbortDecision.NOT_TRAINING
    if raises_by_itself(backend):
        return AbortDecision.NOT_NEEDED
    return AbortDecision.ABORT


def abort_all_groups() -> None:
    """Abort every process group of this process (DeepSpeed's sub-groups too; NCCL's inside one
    ``ncclGroupStart/End``, so the aborts cannot deadlock each other). A user abort stops the NCCL
    watchdog first: it does not end the process, whatever ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` says."""
    from torch.distributed import distributed_c10d

    abort = getattr(distributed_c10d, "_abort_process_group", None)
    if abort is None:
        raise RuntimeError("this torch has no torch.distributed.distributed_c10d._abort_process_group")
    abort()


class CollectiveAbort:
    """One rank's answer to "a peer is gone": thread-safe (the request arrives on another thread
    than the training one), at most one abort."""

    def __init__(
        self,
        *,
        backend: str,
        abort: Callable[[], None] = abort_all_groups,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.backend = backend
        self._abort = abort
        self._clock = clock
        self._lock = threading.Lock()
        self._training = False
        self._raised = False
        self.aborted_at: float | None = None
        self.reason = ""
        self.peer_lost = ""
        """Why this rank was told, while training, that a peer is gone ("": it was not)."""

    @property
    def synchronous_errors(self) -> bool:
        """A failed collective raises where it ran (gloo), never handing back a partial result."""
        return raises_by_itself(self.backend)

    def arm(self) -> None:
        """The per-step protocol began: a request from now on may abort."""
        with self._lock:
            self._training = True

    def disarm(self) -> None:
        """The protocol finished: no abort any more (a normal end tears nothing down)."""
        with self._lock:
            self._training = False

    @property
    def has_raised(self) -> bool:
        """Whether the training thread has had control back (see :meth:`raised`)."""
        with self._lock:
            return self._raised

    def raised(self) -> bool:
        """The training thread has control back (its step raised). True if an abort released it."""
        with self._lock:
            self._raised = True
            return self.aborted_at is not None

    def request(self, reason: str) -> AbortDecision:
        """A peer is gone (``reason`` says how this rank heard): abort where that releases a blocked
        collective (see :func:`decide`). Never raises: a failed abort is logged."""
        with self._lock:
            decision = decide(
                backend=self.backend, training=self._training, raised=self._raised, aborted=self.aborted_at is not None
            )
            if decision is AbortDecision.ABORT:
                self.aborted_at, self.reason = self._clock(), reason
            if decision in (AbortDecision.ABORT, AbortDecision.NOT_NEEDED):  # training, not raised yet
                self.peer_lost = self.peer_lost or reason
        if decision is not AbortDecision.ABORT:
            logger.info("collective abort asked (%s): %s (backend %s)", reason, decision.value, self.backend)
            return decision
        logger.warning("aborting every process group (%s): a collective blocked on a lost peer returns", reason)
        try:
            self._abort()
        except Exception:  # noqa: BLE001 - a request comes from a controller that must not fail with it
            logger.exception("aborting the process groups failed; the rank waits for its collective's timeout")
        return decision


_installed: CollectiveAbort | None = None
#: The last watcher's training thread had raised when it was uninstalled: this rank's train
#: function ended after a failure, so a late request (the controller's, racing the function's
#: exit) is answered as that watcher would have, not as a process that never had one.
_ended_after_raise = False


def install(abort: CollectiveAbort | None) -> CollectiveAbort | None:
    """Make ``abort`` the one :func:`request_abort` reaches in this process (``None``: none)."""
    global _installed, _ended_after_raise
    previous, _installed = _installed, abort
    _ended_after_raise = abort is None and previous is not None and previous.has_raised
    return abort


def for_current_group() -> CollectiveAbort:
    """A :class:`CollectiveAbort` for this process's default group (initialised)."""
    import torch.distributed as dist

    return CollectiveAbort(backend=str(dist.get_backend()))


def request_abort(reason: str) -> str:
    """What Ray Train's controller runs inside a survivor's process when a peer died
    (:mod:`layercheck.orchestrator.runtime.capture_hold`): the :class:`AbortDecision` taken, by value."""
    abort = _installed
    if abort is None:
        return (AbortDecision.ALREADY_RAISED if _ended_after_raise else AbortDecision.NO_WATCHER).value
    return abort.request(reason).value


def peer_lost() -> str:
    """Why the installed watcher was told, while its rank trained, that a peer is gone ("": it
    was not, or none is installed): a wait outside the collectives raises :class:`PeerLost` on it."""
    abort = _installed
    return abort.peer_lost if abort is not None else ""
