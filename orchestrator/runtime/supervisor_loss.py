"""A lost supervisor ends the run, in one line, with the way to continue it.

The supervisor actor commits every version, plans every recovery and owns the writer actors (they
die with it, and with them what they held in memory): without it nothing more can be committed
or recovered, so it is not rebuilt. Its loss is told apart from a worker's: the driver sees it at
its next progress poll (``fit_watch``) and asks the ranks, through the policy actor, to stop after
the same step; Ray Train's controller ends the run instead of restarting a group that could not
join (``setup_errors.SetupErrorsEndTheRun``); and the driver's end says why in one line and prints
the resume command (``driver.finish_run``, ``layercheck train``), never Ray's ``WorkerGroupError``.
What the store committed is intact: ``--resume`` continues from its newest recoverable step.
"""

from __future__ import annotations

import ray


class SupervisorLost(RuntimeError):
    """The run's supervisor actor died: the run ends (raised in Ray Train's controller, so that
    the worker group is not restarted)."""


def supervisor_died(error: BaseException) -> bool:
    """``error`` (from a call to the supervisor) says it is dead for good: its process died, and
    it is never restarted. A call that merely timed out or found it unreachable for a while is not."""
    return isinstance(error, ray.exceptions.ActorDiedError)


def lost_reason(step: int | None) -> str:
    """The run's one-line error once its supervisor is gone (``step``: the last step the driver
    heard of from it)."""
    heard = f"; the last step it reported: {step}" if step else ""
    return (
        f"the run's supervisor actor died (its persistence writers with it{heard}): nothing more can "
        "be committed, so the run ends; every version committed before is intact"
    )
