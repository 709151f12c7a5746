"""The end of a run on the driver (:func:`finish_run`): the writers drained, the final state and
the drift trace recorded, the run's actors stopped, and its :class:`RunResult`. It never raises:
what fails at the end is logged and listed in ``RunResult.end_errors``, so the summary is always
printed. The start and the watched ``fit`` are ``driver.py``'s and ``fit_watch.py``'s."""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import ray

from layercheck.orchestrator.core.run_config import RunConfig
from layercheck.orchestrator.core.run_status import RunStatus
from layercheck.orchestrator.runtime.fit_watch import RunHandles, supervisor_gone
from layercheck.orchestrator.runtime.handles import PolicyHandle, SupervisorHandle, kill
from layercheck.orchestrator.runtime.metrics_discovery import remove_discovery
from layercheck.orchestrator.runtime.supervisor_loss import supervisor_died
from layercheck.orchestrator.store.layer_store import DRIFT_TRACE_FILE, LayerStore
from layercheck.orchestrator.store.lease import StoreLease, stopped_for_the_lease
from layercheck.orchestrator.store.recovery_source import stored_at
from layercheck.policies.configs import PolicyConfig
from layercheck.policies.trace import DriftTrace

logger = logging.getLogger(__name__)

#: Seconds the driver's calls to the run's actors at the end may take beyond their own bounds.
ANSWER_S = 60.0


@dataclass
class RunResult:
    run_id: str
    config: RunConfig | None
    """The built-in loop's run config; ``None`` for a user's own loop (``layercheck.LayerCheckTrainer``)."""
    status: dict[str, Any]
    """The supervisor's final view (``RunStatus.as_dict``), with what the writers hold in memory
    (``"memory"``) and what the store holds (``"stored"``). JSON, as users' code reads it."""
    trace: DriftTrace
    """The run's drift trace: per step, the learning rate and every layer's drift."""
    layer_numel: dict[str, int]
    error: str | None = None
    metrics_url: str | None = None
    """Where the run's Prometheus metrics were served (while the run was live); ``None``: disabled."""
    storage_uri: str = ""
    """Where the run's checkpoints are (the config's storage when empty)."""
    policy: PolicyConfig | None = None
    """The checkpoint policy the run used (the config's when ``None``)."""
    interrupted: bool = False
    """Stopped by Ctrl-C (SIGINT) on the driver: resume it with ``--resume``."""
    train_reports: list[dict[str, object]] = field(default_factory=list)
    """Rank 0's metrics of each ``ray.train.report`` (step, loss, max_staleness, ettr; built-in
    loop, Train v2), as Ray Train's controller received them, oldest first."""
    end_errors: list[str] = field(default_factory=list)
    """What failed in the driver's end-of-run work (drain, drift trace, final status): logged and
    shown in the summary, never raised, so the summary is always printed."""
    schedule: dict[str, object] = field(default_factory=dict)
    """The policy actor's :meth:`~layercheck.orchestrator.runtime.policy_actor.PolicyActor.schedule_view`
    at the end: peak bytes per step, the write budget and the drain bandwidth (empty if unread)."""
    supervisor_lost: str = ""
    """Why the run's supervisor died ("": it did not): the run ended with it, and its store
    resumes (``layercheck train`` prints the command)."""
    memory_period: int = 0
    """``persistence.memory_period`` of the run at its start (the config's when it has one; under
    ``"auto"`` the supervisor's status has the period chosen): the staleness its recoveries
    promised (0: no memory versions)."""

    def __post_init__(self) -> None:
        if self.config is not None:
            self.memory_period = self.memory_period or self.config.persistence.memory_period_at_start
            self.storage_uri = self.storage_uri or self.config.storage_uri
            self.policy = self.policy if self.policy is not None else self.config.policy


def finish_run(handles: RunHandles, *, error: str | None, config: RunConfig | None = None) -> RunResult:
    """Let the writers finish, record the final state and the drift trace, stop the actors.
    Never raises: what fails here is logged and listed in ``RunResult.end_errors``. A supervisor
    that died ends the run with its one-line reason (``supervisor_loss.py``), in place of the
    error Ray Train raised for it; what is known then comes from the driver's last poll, the
    policy actor and the store."""
    supervisor, policy = handles.supervisor, handles.policy
    end_errors: list[str] = []
    if not handles.supervisor_lost and _supervisor_died(supervisor):
        supervisor_gone(handles)
    lost = handles.supervisor_lost
    last: RunStatus | None
    if lost:
        error = lost
        last = dataclasses.replace(handles.last_status, state="failed") if handles.last_status is not None else None
    else:
        last, error = _end_with_the_supervisor(supervisor, handles.stop_drain_s, error, end_errors)
    drain_s = handles.stop_drain_s
    trace = DriftTrace.from_json(
        {"steps": [], "layers": [{"name": name, "numel": numel} for name, numel in handles.layer_numel.items()]}
    )
    trace = _at_end(
        "collecting the drift trace", end_errors, lambda: _drift_trace(policy, handles.layer_numel), default=trace
    )
    if stopped_for_the_lease(last.stop_reason if last is not None else None) or _lapsed(
        handles.lease
    ):  # (maybe) another run's now
        logger.warning("not writing %s: this run no longer holds its store's lease", DRIFT_TRACE_FILE)
    else:
        _at_end(
            f"writing {DRIFT_TRACE_FILE}",
            end_errors,
            lambda: LayerStore.open(handles.storage_uri).fs.write_bytes(
                DRIFT_TRACE_FILE, json.dumps(trace.to_json()).encode()
            ),
            timeout_s=drain_s,
        )
    schedule = _at_end(
        "reading the schedule's figures",
        end_errors,
        lambda: ray.get(policy.schedule_view.remote(), timeout=60),
        default={},
    )
    final, memory = (last, {}) if lost else _final_status(supervisor, last, end_errors)
    step = final.step if final is not None else 0
    stored = _at_end(
        "reading what the store holds",
        end_errors,
        lambda: stored_at(LayerStore.open(handles.storage_uri), handles.layer_numel, step),
        timeout_s=drain_s,
    )
    status = final.as_dict() if final is not None else {}
    status |= {"memory": memory} if memory else {}
    status |= {"stored": stored} if stored else {}
    train_reports = (
        []
        if lost
        else _at_end(
            "reading the Ray Train reports",
            end_errors,
            lambda: ray.get(supervisor.train_reports.remote(), timeout=60),
            default=[],
        )
    )
    result = RunResult(
        run_id=handles.run_id,
        config=config,
        status=status,
        trace=trace,
        layer_numel=handles.layer_numel,
        error=error,
        metrics_url=handles.metrics_url,
        storage_uri=handles.storage_uri,
        policy=handles.policy_config,
        interrupted=handles.interrupted,
        train_reports=train_reports,
        end_errors=end_errors,
        schedule=schedule,
        supervisor_lost=lost,
        memory_period=handles.memory_period,
    )
    if handles.metrics_url is not None and not lost:  # the final values reach Prometheus before the exporter ends
        _at_end("flushing the metrics", end_errors, lambda: ray.get(supervisor.flush_metrics.remote(), timeout=120))
    remove_discovery(handles.discovery_file)  # the exporter ends with the supervisor: stop pointing at it
    for actor in (supervisor, policy):
        _at_end("stopping the run's actors", end_errors, functools.partial(kill, actor))
    return result


def _drift_trace(policy: PolicyHandle, layer_numel: Mapping[str, int]) -> DriftTrace:
    """The run's drift trace, from the policy actor, with the layers' sizes."""
    steps = ray.get(policy.trace.remote(), timeout=60)
    return DriftTrace.from_json(
        {**steps, "layers": [{"name": name, "numel": numel} for name, numel in layer_numel.items()]}
    )


def _supervisor_died(supervisor: SupervisorHandle) -> bool:
    """Whether the run's supervisor is dead for good (a call to it says so)."""
    try:
        ray.get(supervisor.status.remote(), timeout=60)
    except Exception as error:  # noqa: BLE001 - only its death counts: the end's own calls say the rest
        return supervisor_died(error)
    return False


def _end_with_the_supervisor(
    supervisor: SupervisorHandle, drain_s: float, error: str | None, end_errors: list[str]
) -> tuple[RunStatus | None, str | None]:
    """The supervisor's part of the end: the final drain, its status, and the end recorded; the
    status and the run's error (a setup error or a stop's reason where the trainer raised none)."""
    # persistence.stop_drain_s after the last step, also for a run that ended by itself: the ranks'
    # final hand-over waits within the same bound, and what the writers have not written by then is
    # counted lost, so storage that hangs costs that long and not until it answers (the timeout
    # here only guards against a supervisor that does not answer at all)
    _at_end(
        "draining the writers",
        end_errors,
        lambda: ray.get(supervisor.drain.remote(drain_s), timeout=drain_s + ANSWER_S),
    )
    status: RunStatus | None = _at_end(
        "reading the run's status", end_errors, lambda: ray.get(supervisor.status.remote(), timeout=60)
    )
    if status is not None and status.setup_error:  # the trainer's error wraps it in Ray Train's ControllerError
        error = status.setup_error
    if error is None and status is not None and status.stop_reason:
        error = f"stopped after step {status.step}: {status.stop_reason}"
    _at_end(
        "recording the end of the run",
        end_errors,
        lambda: ray.get(supervisor.finish.remote(error is None, error or ""), timeout=60),
    )
    return status, error


def _final_status(
    supervisor: SupervisorHandle, status: RunStatus | None, end_errors: list[str]
) -> tuple[RunStatus | None, dict[str, object]]:
    """The supervisor's status after the end was recorded, and what the writers hold in memory."""
    final: RunStatus | None = _at_end(
        "reading the run's final status",
        end_errors,
        lambda: ray.get(supervisor.status.remote(), timeout=60),
        default=status,
    )
    memory = _at_end(
        "reading what the writers hold in memory",
        end_errors,
        lambda: ray.get(supervisor.memory_view.remote(), timeout=60),
        default={},
    )
    return final, memory


def _at_end(
    what: str, errors: list[str], fn: Callable[[], Any], default: Any = None, *, timeout_s: float | None = None
) -> Any:
    """``fn()``, or — if it raises — ``default``, with the error logged and listed in ``errors``.
    ``timeout_s``: ``fn`` reads or writes the store, which may hang past any client timeout (an NFS
    mount that stopped answering): it runs in a thread of its own, and after ``timeout_s`` the
    driver goes on without it (``default``, listed as an error; the thread ends with the process)."""
    started = time.monotonic()
    try:
        return fn() if timeout_s is None else _within(fn, timeout_s)
    except Exception as error:  # noqa: BLE001 - the driver's end must always reach the summary
        message = f"{what} failed after {time.monotonic() - started:.1f}s: {type(error).__name__}: {error}"
        logger.error("%s", message)
        errors.append(message)
        return default


def _within(fn: Callable[[], Any], timeout_s: float) -> Any:
    """``fn()`` in a daemon thread, waited for at most ``timeout_s``: :class:`TimeoutError` after that."""
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["value"] = fn()
        except BaseException as error:  # noqa: BLE001 - carried to the caller's thread
            outcome["error"] = error

    thread = threading.Thread(target=run, name="layercheck-end-io", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise TimeoutError(f"storage did not answer within {timeout_s:g}s (persistence.stop_drain_s)")
    if "error" in outcome:
        raise outcome["error"]
    return outcome.get("value")


def _lapsed(lease: StoreLease | None) -> bool:
    """The driver's own lease has expired without a renewal reaching the store."""
    return lease is not None and lease.valid_until <= time.time()
