"""Recovery of a local run after a failure, in one place: the seam where a Ray-free recovery
state machine (``orchestrator/core``) can take over the decisions.

The steps and their order are the Ray runtime's (``runtime/supervisor.py`` ``_start_attempt``,
``runtime/train_fn.py`` ``_recover``): ``t_fail`` is the last step every rank reported; the
writers finish what they hold (with a deadline) and whole versions are committed; incomplete
ones are abandoned; rank 0 plans the composite at ``t_fail`` from the manifest
(:func:`resolve_plan`) and tells every rank; every rank loads its slices
(:func:`load_composite`) and moves the engine to ``t_fail``; the policy replicas are rebased on
the versions loaded (``PolicyService.restart``). Training resumes at ``t_fail + 1``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass

import torch.distributed as dist

from orchestrator.core.composite import load_composite
from orchestrator.local.coordinator import LocalCoordinator
from orchestrator.store.manifest import VersionRecord
from orchestrator.store.recovery_source import ResolvedPlan, resolve_plan
from policies.plan import NoUsableVersionError
from workers.engine import TrainEngine, seek_step

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class Recovered:
    t_fail: int
    start_step: int
    """The first step to train: ``t_fail + 1``, or 1 when there was no composite to load."""
    records: Mapping[str, VersionRecord] | None
    """Per layer, the version loaded; ``None``: nothing loaded (start from the initial weights)."""
    drained: bool
    """Whether every writer and the committer finished within the deadline."""
    drain_s: float
    plan_s: float
    load_s: float
    weighted_staleness: float = 0.0
    max_staleness: int = 0

    @property
    def versions(self) -> dict[str, int]:
        return {layer: r.step for layer, r in (self.records or {}).items()}


def recover(te: TrainEngine, coordinator: LocalCoordinator, *, layer_numel: Mapping[str, int],
            drain_timeout_s: float = 300.0, skip: Mapping[str, str] | None = None) -> Recovered:
    """Recover every rank of a local run (collective). The engine's state may be anything
    (lost); on return it holds the composite at ``t_fail`` unless ``records`` is ``None``."""
    t_fail = coordinator.last_complete_step()
    started = time.monotonic()
    drained = coordinator.drain(drain_timeout_s)
    coordinator.forget_incomplete()
    drain_s = time.monotonic() - started
    started = time.monotonic()
    resolved = _plan(coordinator, layer_numel, t_fail, skip or {}) if coordinator.rank == 0 else None
    box = [resolved]
    dist.broadcast_object_list(box, src=0)
    resolved = box[0]
    plan_s = time.monotonic() - started
    resume_after = t_fail if resolved is not None else 0
    load_s = load_composite(te, coordinator.store, resolved.records) if resolved is not None else 0.0
    seek_step(te, resume_after)
    persisted = {layer: r.step for layer, r in resolved.records.items()} if resolved is not None else {}
    coordinator.restart(resume_after=resume_after, persisted_steps=persisted)
    recovered = Recovered(t_fail=t_fail, start_step=resume_after + 1,
                          records=dict(resolved.records) if resolved is not None else None,
                          drained=drained, drain_s=drain_s, plan_s=plan_s, load_s=load_s,
                          weighted_staleness=resolved.plan.weighted_staleness if resolved is not None else 0.0,
                          max_staleness=resolved.plan.max_staleness if resolved is not None else 0)
    logger.warning("recovered after step %d: resuming at step %d (max staleness %d)", t_fail,
                   recovered.start_step, recovered.max_staleness)
    return recovered


def _plan(coordinator: LocalCoordinator, layer_numel: Mapping[str, int], t_fail: int,
          skip: Mapping[str, str]) -> ResolvedPlan | None:
    try:
        return resolve_plan(coordinator.store, layer_numel, t_fail, deep=False, skip=skip)
    except NoUsableVersionError as error:
        logger.warning("no composite to recover from (%s): training restarts from the initial weights", error)
        return None
