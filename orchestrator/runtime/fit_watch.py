"""Running a ``TorchTrainer``'s ``fit`` under LayerCheck's eye, on the driver: the supervisor
polled for progress (and a lost worker group announced in LayerCheck's own words), Ctrl-C or
SIGTERM turned into a clean stop after the same step on every rank (:func:`fit_watched`), and a
supervisor found dead turned into the same stop (``supervisor_loss.py``)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType
from typing import TYPE_CHECKING, Protocol

import ray

from layercheck.orchestrator.core.accounting import format_sources
from layercheck.orchestrator.core.run_status import RunStatus
from layercheck.orchestrator.core.stall_watch import StallWatch, stall_message
from layercheck.orchestrator.runtime.handles import PolicyHandle, SupervisorHandle
from layercheck.orchestrator.runtime.supervisor_loss import lost_reason, supervisor_died
from layercheck.policies.configs import PolicyConfig

if TYPE_CHECKING:
    from layercheck.orchestrator.store.lease import StoreLease

logger = logging.getLogger(__name__)


@dataclass
class RunHandles:
    """The live actors of one run, as :func:`start_run` started them."""

    run_id: str
    storage_uri: str
    policy_config: PolicyConfig
    layer_numel: dict[str, int]
    policy: PolicyHandle
    supervisor: SupervisorHandle
    metrics_url: str | None
    discovery_file: str | None = None
    """The Prometheus ``file_sd`` file naming the exporter (removed when the run ends)."""
    stop_drain_s: float = 120.0
    """On Ctrl-C: how long to wait for the ranks to stop; at every end, how long after the last
    step the writers may take to commit (``persistence.stop_drain_s``)."""
    lease: StoreLease | None = None
    """The driver's lease on the store (``None``: none)."""
    interrupted: bool = False
    interrupted_by: str = "Ctrl-C"
    last_status: RunStatus | None = None
    """The supervisor's status at the driver's last poll (what is known of a run whose supervisor died)."""
    supervisor_lost: str = ""
    """Why the run's supervisor is gone ("": it is not): the run ends, its store resumes."""
    memory_period: int = 0
    """``persistence.memory_period``: the staleness the run's recoveries promise (0: none)."""
    stall_after_s: float = 600.0
    """How long the run may go without a step before the driver says it stalled, and who had not
    reported the next step (``persistence.decision_timeout_s``)."""


class Fits(Protocol):
    """A trainer whose ``fit()`` runs the training (Ray Train's ``TorchTrainer`` and ours)."""

    def fit(self) -> object: ...


#: What the driver's progress hook gets at each poll: the supervisor's status, as the run's result has it.
ProgressHook = Callable[[dict[str, object]], None]
#: A SIGTERM handler as ``signal.signal`` takes and returns it.
SignalHandler = Callable[[int, FrameType | None], object] | int | None


class Terminated(KeyboardInterrupt):
    """SIGTERM on the driver (``kill``, a scheduler's stop): handled exactly like Ctrl-C
    (:func:`raise_on_sigterm`)."""


def raise_on_sigterm() -> SignalHandler:
    """Until the previous handler (returned) is put back, SIGTERM raises :class:`Terminated` in
    the main thread, as Ctrl-C raises ``KeyboardInterrupt``: the run stops after the same step on
    every rank, saves its final state and prints its summary and resume command, instead of dying
    mid-step (Ray's own handler exits the driver at once)."""
    import signal

    def _raise(signum: int, frame: FrameType | None) -> None:
        raise Terminated()

    return signal.signal(signal.SIGTERM, _raise)


def fit_watched(
    handles: RunHandles,
    trainer: Fits,
    *,
    on_progress: ProgressHook | None = None,
    poll_s: float = 1.0,
    fault_note: str = "",
) -> str | None:
    """``trainer.fit()`` while polling the supervisor for progress; the error that ended the
    run for good (max_failures exhausted, a bug in a worker), or ``None``.

    Ctrl-C (SIGINT), or SIGTERM, stops the run cleanly: ``fit`` runs in a thread of its own (so Ray Train does
    not install its SIGINT handler, which aborts the workers mid-step), and the interrupt asks
    every rank, through the supervisor, to stop after the same step and persist its final state;
    the driver waits up to ``handles.stop_drain_s`` for that (a second Ctrl-C stops waiting)."""
    import signal

    stop = threading.Event()
    # after ray.init, which installs its own SIGTERM handler; only the main thread may set one
    previous = raise_on_sigterm() if threading.current_thread() is threading.main_thread() else None
    watcher = threading.Thread(target=_watch, args=(handles, on_progress, stop, poll_s, fault_note), daemon=True)
    watcher.start()
    outcome: dict[str, str] = {}
    # waited on through an Event: a KeyboardInterrupt inside Thread.join can leave the thread
    # marked stopped while it runs on (CPython 3.11), and the driver would not wait for it
    fitted = threading.Event()
    runner = threading.Thread(target=_fit, args=(trainer, outcome, fitted), name="trainer-fit", daemon=True)
    runner.start()
    try:
        try:
            while not fitted.wait(0.5):
                pass
        except KeyboardInterrupt as interrupt:
            handles.interrupted = True
            handles.interrupted_by = "SIGTERM" if isinstance(interrupt, Terminated) else "Ctrl-C"
            _stop_on_interrupt(handles, fitted)
    finally:
        stop.set()
        watcher.join()
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    if handles.interrupted:
        return outcome.get("error") or f"interrupted ({handles.interrupted_by})"
    return outcome.get("error")


def _fit(trainer: Fits, outcome: dict[str, str], fitted: threading.Event) -> None:
    try:
        trainer.fit()
    except BaseException as exc:  # noqa: BLE001 - carried to the driver's thread
        outcome["error"] = f"{type(exc).__name__}: {exc}"
        logger.error("training failed: %s", outcome["error"])
    finally:
        fitted.set()


def _stop_on_interrupt(handles: RunHandles, fitted: threading.Event) -> None:
    """Ask the ranks to stop after the same step and wait (bounded) for the trainer to return."""
    logger.warning(
        "%s: stopping after the same step on every rank (the next that hears from the policy: within "
        "policy.drift_every steps) and saving what is in flight (up to %.0fs; Ctrl-C again to stop waiting)",
        handles.interrupted_by,
        handles.stop_drain_s,
    )
    try:
        ray.get(handles.supervisor.request_stop.remote(f"interrupted ({handles.interrupted_by})"), timeout=10)
        fitted.wait(handles.stop_drain_s)
    except KeyboardInterrupt:
        logger.warning("Ctrl-C again: not waiting for the workers")
        return
    except Exception as error:  # noqa: BLE001 - the supervisor is gone: nothing to wait for
        logger.error("could not ask the workers to stop: %s", error)
        return
    if not fitted.is_set():
        logger.error(
            "the workers did not stop within %.0fs (persistence.stop_drain_s): ending without them",
            handles.stop_drain_s,
        )


def _watch(
    handles: RunHandles,
    on_progress: ProgressHook | None,
    stop: threading.Event,
    poll_s: float,
    fault_note: str = "",
) -> None:
    seen = Announced()
    stalls = StallWatch(after_s=handles.stall_after_s)
    while not stop.wait(poll_s):
        try:
            status = ray.get(handles.supervisor.status.remote(), timeout=10)
            handles.last_status = status
            announce_failures(status, seen, fault_note)
            waited = stalls.stalled_for(status.step, training=status.state == "running", now=time.monotonic())
            if waited is not None:
                announce_stall(handles, status, waited)
            if on_progress is not None:
                on_progress(status.as_dict())
        except Exception as error:  # progress display must never end the run
            if supervisor_died(error):
                supervisor_gone(handles)
                return
            logger.debug("progress poll failed: %s", error)


def announce_stall(handles: RunHandles, status: RunStatus, waited_s: float) -> None:
    """Say that the run has made no step for ``waited_s``, with the ranks that had not reported
    the next one (a stall is otherwise silent until a timeout ends it)."""
    try:
        missing: dict[int, int] | None = ray.get(handles.policy.missing_reports.remote(status.step + 1), timeout=10)
    except Exception as error:  # noqa: BLE001 - the message says the policy actor did not answer
        logger.debug("missing_reports: %s", error)
        missing = None
    logger.error("%s", stall_message(status.step, waited_s, missing, status.world_size))


def supervisor_gone(handles: RunHandles) -> None:
    """The supervisor died: say so once, and ask every rank (through the policy actor, which the
    ranks hear from at each measured step) to stop after the same step, rather than train on with
    nothing committed until a hand-over to a dead writer fails."""
    if handles.supervisor_lost:
        return
    handles.supervisor_lost = lost_reason(handles.last_status.step if handles.last_status is not None else None)
    logger.error("LAYERCHECK: %s", handles.supervisor_lost)
    try:
        handles.policy.request_stop.remote(handles.supervisor_lost)
    except Exception as error:  # noqa: BLE001 - the ranks then find out at their next hand-over
        logger.warning("could not ask the ranks to stop: %s", error)


@dataclass
class Announced:
    """What :func:`announce_failures` has said so far, poll to poll."""

    state: str = ""
    """The supervisor's state at the last poll."""
    recoveries: int = 0
    """Recoveries already announced."""
    lost: bool = False
    """A loss (or a grow) was announced and its recovery not yet."""


def announce_failures(status: RunStatus, seen: Announced, fault_note: str = "") -> list[str]:
    """LayerCheck's own account of a lost worker group, one WARNING line when it is seen and one
    when training resumes (one line for both when the recovery was over before a poll saw it),
    so it stands out from Ray's tracebacks; the lines logged."""
    lines = []
    note = f" ({fault_note})" if fault_note else ""
    state = status.state
    if state == "recovering" and seen.state != "recovering" and status.grown_from:
        lines.append(
            f"LAYERCHECK: Ray Train grows the worker group from {status.grown_from} to "
            f"{status.world_size} workers after step {status.step} (room came back): it "
            "restarts the workers, and LayerCheck resumes them like a recovery, after the last complete step"
        )
        seen.lost = True
    elif state == "recovering" and seen.state != "recovering" and status.attempt > 1:
        # (attempt 1 recovering: a --resume planning its composite, no group was lost)
        lines.append(
            f"LAYERCHECK: worker group lost after step {status.step}{note}: Ray Train restarts the "
            "workers, LayerCheck loads each layer's newest committed version and training resumes after "
            "the last complete step (Ray's tracebacks above are that loss)"
        )
        seen.lost = True
    recoveries = status.account.get("recoveries", [])
    for r in recoveries[seen.recoveries :]:
        announced, seen.lost = seen.lost, False
        if r.get("grown_from"):
            grown = "" if announced else f"Ray Train grew the worker group after step {r['t_fail']}; "
            lines.append(
                f"LAYERCHECK: {grown}resumed with {r['world_size']} workers (was {r['grown_from']}): "
                f"training resumes at step {r['resumed_at']}; composite staleness max {r['max_staleness']}"
            )
            continue
        if r.get("kind") == "resume":
            lines.append(
                f"LAYERCHECK: --resume: the stored run continues at step {r['resumed_at']} with "
                f"{r.get('world_size') or '?'} worker(s); composite staleness max {r['max_staleness']}"
                + (f"; elements from {format_sources(r['sources'])}" if r.get("sources") else "")
            )
            continue
        lost = "" if announced else f"worker group lost after step {r['t_fail']}{note}; "
        size = f" with {r['world_size']} worker{'s' if r['world_size'] > 1 else ''}" if r.get("world_size") else ""
        lines.append(
            f"LAYERCHECK: {lost}recovered: training resumes at step {r['resumed_at']}{size} (lost after step "
            f"{r['t_fail']}); composite staleness max {r['max_staleness']}, steps redone {r['steps_redone']}"
            + (f"; elements from {format_sources(r['sources'])}" if r.get("sources") else "")
        )
    seen.state, seen.recoveries = state, len(recoveries)
    for line in lines:
        logger.warning("%s", line)
    return lines
