"""LayerCheck's progress in Ray Train's own channel: ``ray.train.report`` every ``log_every`` steps.

Ray Train's ``report`` is a collective: every rank must call it the same number of times, or
the group hangs at the next one (Train v2 syncs each call across ranks). The ranks report after
the same steps (``step % log_every == 0``; a requested stop ends every rank after the same step;
a restarted group starts every rank at the same step), so the counts match.

The metrics are what a rank knows without waiting on the critical path: its step, loss and
process id (with ``cluster.in_place`` a survivor's stays the same across a recovery), and
— rank 0 — the committed versions' max staleness and the ETTR so far, asked from the supervisor
at one report and read at the next (a value ``log_every`` steps old; ``None`` until one arrived).
Other ranks report the same keys with ``None`` for what only the supervisor knows.

Train v2 keeps no metrics of a report without a checkpoint in ``Result`` (``Result.metrics`` and
``metrics_dataframe`` come from checkpoints, and LayerCheck's checkpoints are its own), so the
driver adds :class:`ReportsToSupervisor` to the run's callbacks: the controller hands rank 0's
metrics of every report to the supervisor, and ``RunResult.train_reports`` holds them.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any

import ray
import ray.train

from layercheck.orchestrator.core.persistence.config import PersistenceConfig
from layercheck.orchestrator.runtime.callback_base import user_callback_base
from layercheck.orchestrator.runtime.capture_hold import CaptureHold
from layercheck.orchestrator.runtime.handles import SupervisorHandle
from layercheck.orchestrator.runtime.setup_errors import SetupErrorsEndTheRun

logger = logging.getLogger(__name__)

#: The keys of every LayerCheck ``ray.train.report``.
REPORT_KEYS = ("step", "loss", "pid", "max_staleness", "ettr")


class TrainReporter:
    """One rank's ``ray.train.report`` calls; call it after every step."""

    def __init__(self, *, rank: int, every: int, supervisor: SupervisorHandle, to_ray: bool = True) -> None:
        """``to_ray``: call ``ray.train.report`` (off: report nothing, e.g. with ``cluster.spares``,
        whose waiting workers make no steps to report and would leave the barrier waiting)."""
        self.rank = rank
        self.every = every if to_ray else 0
        self.supervisor = supervisor
        self._asked: ray.ObjectRef[dict[str, float | int | None]] | None = None
        self._view: dict[str, float | int | None] = {"max_staleness": None, "ettr": None}

    def __call__(self, step: int, loss: float) -> None:
        if self.every and step % self.every == 0:
            ray.train.report(self.metrics(step, loss))

    def final(self, step: int, loss: float | None, **extra: object) -> None:
        """The report every rank makes once at the end."""
        if self.every:
            ray.train.report({**self.metrics(step, loss), **extra})

    def metrics(self, step: int, loss: float | None) -> dict[str, object]:
        if self.rank == 0:
            self._collect()
        return {"step": step, "loss": loss, "pid": os.getpid(), **self._view}

    def _collect(self) -> None:
        """Take the supervisor's answer to the last question if it has come, and ask again."""
        if self._asked is not None:
            ready, _ = ray.wait([self._asked], timeout=0)
            if not ready:
                return  # still on its way: keep the older view, do not pile up questions
            try:
                self._view = ray.get(self._asked)
            except Exception as error:  # noqa: BLE001 - progress reporting must never end the run
                logger.debug("supervisor view for ray.train.report unavailable: %s", error)
        self._asked = self.supervisor.train_view.remote()


def supervisor_callbacks(supervisor: SupervisorHandle, *, capture_timeout_s: float | None = None) -> list[object]:
    """The run's Ray Train callbacks (Train v2 only; v1 keeps report metrics in
    ``Result.metrics_dataframe`` itself, and has no hook before a group's teardown): rank 0's
    report metrics to the supervisor, a setup error ending the run unretried
    (:mod:`~layercheck.orchestrator.runtime.setup_errors`) and, with ``capture_timeout_s`` (``persistence.capture`` on),
    the teardown hold for survivors' captures (:mod:`layercheck.orchestrator.runtime.capture_hold`)."""
    from ray.train.v2._internal.constants import is_v2_enabled

    if not is_v2_enabled():
        return []
    hold = [] if capture_timeout_s is None else [CaptureHold(supervisor, bound_s=capture_timeout_s)]
    return [ReportsToSupervisor(supervisor), SetupErrorsEndTheRun(supervisor), *hold]


class ReportsToSupervisor(user_callback_base()):  # type: ignore[misc]
    """Runs in Ray Train's controller: forwards rank 0's metrics of each report to the supervisor."""

    def __init__(self, supervisor: SupervisorHandle) -> None:
        self.supervisor = supervisor

    def after_report(self, run_context: object, metrics: list[dict[str, object]], checkpoint: object) -> None:
        if metrics:
            self.supervisor.train_reported.remote(metrics[0])


def with_callbacks(
    run_config: Any, supervisor: SupervisorHandle, persistence: PersistenceConfig, *, in_place: bool = False
) -> Any:  # Any: Ray Train v2's RunConfig (v1's where v2 is off), which mypy sees as v1's whatever runs
    """A user's Ray Train ``RunConfig`` with LayerCheck's callbacks (:func:`supervisor_callbacks`)
    added after the user's own; with ``in_place`` (``cluster.in_place``), the one that sees a worker
    replaced in place (it promotes a spare and releases the survivors)."""
    ours = supervisor_callbacks(supervisor, capture_timeout_s=persistence.capture_hold_s)
    if in_place:  # (imported here: it imports torch, which the driver of a run without it never needs)
        from layercheck.orchestrator.runtime.in_place import ReplaceInPlace

        ours.append(ReplaceInPlace(supervisor))
    return dataclasses.replace(run_config, callbacks=[*(run_config.callbacks or []), *ours])
