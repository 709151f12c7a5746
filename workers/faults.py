"""Injected failures behind one hook.

The product calls :func:`fault_point` at a few named sites (below); an installed injector decides
whether anything fails there. Nothing is installed unless a run asks, and a site then does nothing.
Two injectors can be installed in a process, both reached through the same hook:

- the run's **recovery rehearsal** (``[fault] kill_at_step`` and ``kill_rank``, the one injected
  failure a user configures, e.g. the demo's): :class:`KillRehearsal`, installed by the rank's own
  code from the run's config (:func:`rehearse`);
- a **test's injector**, named by the ``LAYERCHECK_FAULTS`` environment variable: ``module:attr``,
  or a JSON object ``{"injector": "module:attr", ...}`` whose other keys are passed to it; the
  attribute is called and returns the injector. It is imported at the first site a process
  reaches. Set it before Ray starts: the processes of a local Ray inherit the driver's
  environment, and the job's ``runtime_env`` carries it to a cluster joined
  (:func:`layercheck.orchestrator.runtime.cluster.worker_env`). The test-only failures (killed
  writers, stalled writes, errors of a rank's own, failed recoveries) live with the tests
  (``tests/support/faults.py``).
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import signal
from dataclasses import dataclass
from typing import Any, Protocol

logger = logging.getLogger(__name__)

FAULTS_ENV = "LAYERCHECK_FAULTS"

#: A rank finished optimizer step ``step`` and its LayerCheck work. Facts: ``rank``, ``step``,
#: ``attempt`` (1: the run's first group), ``coordinator`` (its ``writer`` actor, ``flush(timeout_s)``).
AFTER_STEP = "after_step"
#: A rank of the built-in loop joined the run (its engine built; in place, its new process group
#: formed), before it loads a composite. Facts: ``rank``, ``attempt``, ``incarnation`` (0: the
#: process's first run of the loop; n: its n-th recovery in its own process).
JOINED = "joined"
#: A writer actor is inside its write of a shard file: the header is written, the temporary file
#: open. Facts: ``writer`` (its name), ``node_id``, ``step`` (the shard's), ``path``.
SHARD_WRITE = "shard_write"


class Injector(Protocol):
    """Whatever fails at a site fails inside :meth:`check`: it raises, sleeps, or kills."""

    def check(self, site: str, **facts: Any) -> None: ...


@dataclass(frozen=True)
class KillRehearsal:
    """The run's recovery rehearsal: rank ``kill_rank`` SIGKILLs itself after step ``kill_at_step``
    of the run's first attempt (0: never)."""

    kill_at_step: int
    kill_rank: int

    def check(self, site: str, **facts: Any) -> None:
        if site != AFTER_STEP or not self.kill_at_step:
            return
        rank, step = facts["rank"], facts["step"]
        if step == self.kill_at_step and rank == self.kill_rank and facts["attempt"] == 1:
            die_after_step(rank, step, facts["coordinator"])


class Flushes(Protocol):
    """What :func:`die_after_step` waits on: the rank's coordinator, its messages sent."""

    def flush(self, timeout_s: float) -> None: ...


def die_after_step(rank: int, step: int, coordinator: Flushes, *, barrier: bool = False) -> None:
    """SIGKILL this process once the step's drift report and the snapshots handed over have left
    it, so that the failure falls exactly after ``step``. (A real crash can also take with it
    messages still in the send queue: then ``t_fail`` is the step before, or the layers whose
    shards were lost come from their previous versions.) ``barrier``: every rank dies at this
    step, and none before all have handed theirs over."""
    coordinator.flush(timeout_s=60)
    if barrier:
        import torch.distributed

        torch.distributed.barrier()
    logger.warning("fault injection: rank %d kills itself after step %d", rank, step)
    os.kill(os.getpid(), signal.SIGKILL)


_rehearsal: Injector | None = None
_injector: Injector | None = None
_loaded = False  # the environment was read (once per process, at its first site)


def fault_point(site: str, **facts: Any) -> None:
    """A named site (``AFTER_STEP``, ``JOINED``, ``SHARD_WRITE``): the installed injectors may fail
    here, the test's first, then the rehearsal."""
    injector = _installed()
    if injector is not None:
        injector.check(site, **facts)
    if _rehearsal is not None:
        _rehearsal.check(site, **facts)


def active() -> bool:
    """Whether any injector is installed in this process (a site that costs work to reach asks first)."""
    return _installed() is not None or _rehearsal is not None


def rehearse(kill_at_step: int, kill_rank: int) -> None:
    """Install the run's recovery rehearsal in this process (``kill_at_step`` 0: none)."""
    global _rehearsal
    _rehearsal = KillRehearsal(kill_at_step, kill_rank) if kill_at_step else None


def install(injector: Injector | None) -> Injector | None:
    """Make ``injector`` this process's test injector in place of ``LAYERCHECK_FAULTS``'s (``None``:
    none); the one it replaces is returned."""
    global _injector, _loaded
    previous = _installed()
    _injector, _loaded = injector, True
    return previous


def load(spec: str) -> Injector:
    """The injector ``spec`` names (``module:attr``, or ``{"injector": "module:attr", ...}``)."""
    options: dict[str, Any] = {}
    target = spec.strip()
    if target.startswith("{"):
        options = json.loads(target)
        target = str(options.pop("injector", ""))
    module, _, attr = target.partition(":")
    if not module or not attr:
        raise ValueError(f"{FAULTS_ENV}: {spec!r} names no injector (module:attr, or a JSON object with 'injector')")
    factory = getattr(importlib.import_module(module), attr)
    injector: Injector = factory(**options)
    logger.warning("fault injection: %s installed from %s", type(injector).__name__, FAULTS_ENV)
    return injector


def _installed() -> Injector | None:
    global _injector, _loaded
    if not _loaded:
        spec = os.environ.get(FAULTS_ENV, "")
        _injector, _loaded = (load(spec) if spec else None), True
    return _injector
