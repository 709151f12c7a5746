"""Ray's known noise, cut on the driver's console: when LayerCheck loses a worker on purpose (an
injected kill) or by accident, Ray Train's controller and the survivors print 60–80 lines of
tracebacks (and a hint that the OOM killer may be to blame) that bury LayerCheck's own account
(the ``LAYERCHECK:`` warnings of :func:`layercheck.orchestrator.runtime.fit_watch.announce_failures`).

The driver keeps printing every line Ray forwards from its workers, except: a traceback is cut to
its first and last line plus a count (the full text stays in Ray's session logs,
``/tmp/ray/session_latest/logs``), and lines known to be noise (:data:`NOISE`) are dropped. Set
``LAYERCHECK_RAY_LOGS=all`` to see everything. :func:`LogFilter.filter` is pure; :func:`install`
hooks it into Ray's driver-side log dispatcher (a private Ray API, hence guarded: if it moved, the
logs print unfiltered).
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

ALL_LOGS_ENV = "LAYERCHECK_RAY_LOGS"
#: Lines Ray prints around a lost worker that say nothing an operator can act on.
NOISE = (
    re.compile(r"Actor with class name: 'PreemptionWatcher'"),
    re.compile(r"Failed to send resource request for train-"),
    re.compile(r"If this only happens transiently during network partition"),
    re.compile(r"(?i)oom killer|out of memory|ray_memory_monitor|memory_usage_threshold"),
    re.compile(r"^\s*class_name: |^\s*actor_id: |^\s*pid: \d+$|^\s*namespace: |^\s*ip: [\d.]+$"),
    re.compile(r"To disable OOM|RAY_memory_monitor_refresh_ms|Refer to the documentation on how to address"),
    # Ray Train's echo of every ray.train.report of every rank: LayerCheck's progress line says it once
    re.compile(r"Reporting training result \d+: TrainingReport\("),
)
_TRACEBACK_START = "Traceback (most recent call last):"
#: Lines that open a block to cut: a traceback, Ray Train's repr of a lost worker.
_BLOCK_START = re.compile(r"^(Traceback \(most recent call last\):|Worker info: Worker\()")
_CONTINUATION = re.compile(r"^(\s|\^|~|\)|During handling|The above exception|\.\.\. \(Output truncated|$)")
_TRUNCATED = "(Output truncated"


@dataclass
class LogFilter:
    _in_traceback: dict[Any, int] = field(default_factory=dict)
    """Per source process, the traceback lines cut so far (absent: not inside one)."""
    _after_truncation: set[Any] = field(default_factory=set)
    dropped: int = 0

    def filter(self, source: Any, lines: Sequence[str]) -> list[str]:
        """The lines of one batch from ``source`` (a pid) worth printing."""
        kept: list[str] = []
        for line in lines:
            if source in self._in_traceback:
                resumes = source in self._after_truncation  # Ray cut the snippet mid-line: still inside
                self._after_truncation.discard(source)
                if resumes or _CONTINUATION.match(line) or _BLOCK_START.match(line):
                    self._in_traceback[source] += 1
                    if _TRUNCATED in line:
                        self._after_truncation.add(source)
                    continue
                cut = self._in_traceback.pop(source)
                self.dropped += cut
                kept.append(
                    f"{line[:300]}  [{cut} traceback lines cut; full text in Ray's session logs, "
                    f"{ALL_LOGS_ENV}=all to print them]"
                )
                continue
            if _BLOCK_START.match(line):
                self._in_traceback[source] = 1
                continue
            if any(pattern.search(line) for pattern in NOISE):
                self.dropped += 1
                continue
            kept.append(line)
        return kept


def install() -> bool:
    """Filter what Ray prints on this driver from its workers, and print it on stderr: the
    driver's stdout is LayerCheck's own (progress, the summary, ``--json``). True if installed."""
    unfiltered = os.environ.get(ALL_LOGS_ENV, "").lower() == "all"
    try:
        import functools

        from ray._private import worker as ray_worker
        from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher

        names = [name for name, _ in dispatcher.handlers]
        if "ray_print_logs" not in names:
            return False
        ignore_prefix = ray_worker._should_ignore_worker_log_prefix(ray_worker.global_worker)
        log_filter = LogFilter()

        def print_filtered(data: dict[str, Any]) -> None:
            lines = data.get("lines") or []
            if not unfiltered:
                lines = log_filter.filter(data.get("pid"), lines)
            if lines:
                ray_worker.print_to_stdstream({**data, "lines": lines, "is_err": True}, ignore_prefix=ignore_prefix)

        dispatcher.remove_handler("ray_print_logs")
        dispatcher.add_handler("ray_print_logs", functools.partial(print_filtered))
        return True
    except Exception as error:  # noqa: BLE001 - a moved private API: print Ray's logs as they are
        logger.debug("Ray's worker logs print unfiltered: %s", error)
        return False
