"""Logging set-up for the processes LayerCheck starts that have no ``main`` of their own.

A Ray actor, a Ray Train worker running the train function, and a spawned local rank start in a
fresh interpreter whose root logger has no handler. Ray does not fill the gap: unless the driver
passes a ``ray.LoggingConfig`` to ``ray.init``, Ray configures only its own ``ray`` logger in worker
processes, so a warning from ``orchestrator.*`` or ``workers.*`` would reach Python's last-resort
handler and print as a bare message, with neither its level nor the logger that raised it. Each
such process therefore calls :func:`configure_process_logging` first thing in its entry (an
actor's ``__init__``, the train function, a spawn target); library code never configures logging.
"""

from __future__ import annotations

import logging

PROCESS_LOG_FORMAT = "%(levelname)s %(name)s: %(message)s"


def configure_process_logging(level: int = logging.WARNING, *, timestamps: bool = False) -> None:
    """Give this process's root logger a stderr handler at ``level`` (Ray forwards a worker's
    stderr to the driver). Does nothing when the root logger already has a handler: a user's
    ``ray.LoggingConfig``, or an earlier call in the same process, wins."""
    fmt = f"%(asctime)s {PROCESS_LOG_FORMAT}" if timestamps else PROCESS_LOG_FORMAT
    logging.basicConfig(level=level, format=fmt)
