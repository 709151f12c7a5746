"""The driver's progress lines while a run trains (``layercheck train``; under ``ray job submit``
what ``ray job logs`` shows): one line per ``log_every`` steps or change of state, from the
supervisor's status. The closing summary is :mod:`~layercheck.orchestrator.runtime.run_summary`'s."""

from __future__ import annotations

import math
from typing import Any

from layercheck.orchestrator.table import human_bytes


class ProgressLines:
    """The driver's progress on stdout (``layercheck train``; under ``ray job submit`` what
    ``ray job logs`` shows): a line when the step crosses a multiple of ``log_every`` or the run's
    state changes, fed the supervisor's status at every poll. Ray's own dashboard does not show
    ``ray.train.report`` metrics (Train v2 in Ray 2.60 keeps none without a checkpoint), so this
    line is where a job's step, loss, staleness and ETTR are read."""

    def __init__(self, log_every: int) -> None:
        self.log_every = log_every
        self._step = -1
        self._state: str | None = None

    def __call__(self, status: dict[str, Any]) -> list[str]:
        """The lines to print for this status (none between boundaries)."""
        lines = []
        if self._state is None and status.get("metrics_url"):
            lines.append(f"metrics at {status['metrics_url']}")
        if status["step"] // self.log_every != self._step // self.log_every or status["state"] != self._state:
            lines.append(format_progress(status))
            self._step, self._state = status["step"], status["state"]
        return lines


def format_progress(status: dict[str, Any]) -> str:
    stale = status["max_staleness"]
    return (
        f"[{status['state']}] step {status['step']}  loss {short_number(status['loss'])}  lr {status['lr']:.2e}  "
        f"written {human_bytes(status['bytes_committed'])} ({status['versions_committed']} versions)  "
        f"max staleness {stale if stale is not None else '-'}  ETTR {status['account']['ettr']:.2f}"
    )


def short_number(value: object) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:.4g}" if isinstance(value, float) else str(value)
