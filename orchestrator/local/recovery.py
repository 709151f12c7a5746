"""Recovery of a local run after a failure: a thin shell over the run's supervisor, which
decides it as it does under Ray (:mod:`layercheck.orchestrator.core.recovery.state_machine`).

Every rank calls :func:`recover` at the same point (it is collective):

1. ``t_fail``: every rank's drift reports gathered, the last step all ranks completed;
2. the group rejoins rank 0's :class:`RunSupervisor` under new worker ids
   (:meth:`LocalCoordinator.rejoin`): the supervision drains every rank's writer (with the
   deadline; writers that miss it are named and replaced), commits or abandons what the lost
   group left, plans the composite at ``t_fail`` — or none: restart from the initial weights at
   step 1 — rebases rank 0's policy replica, and every rank gets the same answer;
3. every rank loads its slices of the composite (:func:`load_composite`; shard files from the
   writers' memory where they hold them, :mod:`layercheck.orchestrator.local.memory`, counted in
   ``Recovered.sources`` and the supervisor's account as under Ray) and the ranks agree on
   the outcome before any goes on: a version a rank found corrupt is reported to the supervisor
   (``version_unusable``) and the group rejoins, so the next plan skips it — as a Ray worker
   group that dies on a corrupt shard is restarted and replanned;
4. every rank moves its engine to the resume point and restarts its policy replica as rank 0's
   was rebased. Training resumes at ``start_step`` (``t_fail + 1`` with a composite).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from layercheck.orchestrator.core.memory.reads import LoadSources, needed_spans
from layercheck.orchestrator.core.recovery.composite import load_composite
from layercheck.orchestrator.local.local_coordinator import LocalCoordinator
from layercheck.orchestrator.local.memory import memory_first_store
from layercheck.orchestrator.store.errors import CorruptShardError
from layercheck.orchestrator.store.manifest import VersionRecord
from layercheck.workers.engine import TrainEngine, seek_step

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class Recovered:
    t_fail: int
    start_step: int
    """The first step to train: ``t_fail + 1``, or 1 when there was no composite to load."""
    records: Mapping[str, VersionRecord] | None
    """Per layer, the whole version loaded; ``None``: nothing loaded (start from the initial weights)."""
    drained: bool
    """Whether every writer (and the commits of what they wrote) finished within the deadline."""
    drain_s: float
    plan_s: float
    load_s: float
    """The slowest rank's loads, failed ones included (with the memory tier: the exchange of the
    writers' copies too)."""
    sources: Mapping[str, float] = field(default_factory=dict)
    """Where every rank's shard files came from (a ``LoadSources`` as JSON, summed over ranks
    and loads): the writers' memory or storage."""
    weighted_staleness: float = 0.0
    max_staleness: int = 0
    unusable: tuple[str, ...] = ()
    """Versions found corrupt while loading (each cost one replan)."""
    overlays: Mapping[str, tuple[VersionRecord, ...]] = field(default_factory=dict)
    """Per layer, the partial versions (survivors' captures) loaded over ``records``, newest first."""

    @property
    def versions(self) -> dict[str, int]:
        return {layer: r.step for layer, r in (self.records or {}).items()}


def recover(train_engine: TrainEngine, coordinator: LocalCoordinator) -> Recovered:
    """Recover every rank of a local run (collective). The engine's state may be anything
    (lost); on return it holds the composite at ``t_fail`` unless ``records`` is ``None`` (then
    the caller restores the initial weights)."""
    t_fail = coordinator.last_complete_step()
    drain_s = plan_s = load_s = 0.0
    drained, unusable = True, []
    sources = LoadSources()
    while True:
        answer = coordinator.rejoin()
        drain_s, plan_s = drain_s + answer.drain_s, plan_s + answer.plan_s
        drained = drained and not answer.replaced
        records = answer.resume.records
        if records is None:
            break
        seconds, corrupt = _load_agreed(train_engine, coordinator, records, answer.resume.overlays, sources)
        load_s += seconds
        if not corrupt:
            break
        unusable += [version_id for version_id, _ in corrupt]
        coordinator.version_unusable(corrupt)
        logger.error("recovery: %s unusable; replanning without", ", ".join(v for v, _ in corrupt))
    start_step = answer.resume.start_step
    seek_step(train_engine, start_step - 1)
    summed = _summed(coordinator, sources)
    coordinator.resumed(answer, load_s, summed)
    recovered = Recovered(
        t_fail=t_fail,
        start_step=start_step,
        records=dict(records) if records else None,
        drained=drained,
        drain_s=drain_s,
        plan_s=plan_s,
        load_s=load_s,
        weighted_staleness=answer.weighted_staleness,
        max_staleness=answer.max_staleness,
        unusable=tuple(unusable),
        overlays=dict(answer.resume.overlays) if records else {},
        sources=summed,
    )
    logger.warning(
        "recovered after step %d: resuming at step %d (max staleness %d)", t_fail, start_step, recovered.max_staleness
    )
    return recovered


def _load_agreed(
    train_engine: TrainEngine,
    coordinator: LocalCoordinator,
    records: Mapping[str, VersionRecord],
    overlays: Mapping[str, tuple[VersionRecord, ...]],
    sources: LoadSources,
) -> tuple[float, list[tuple[str, str]]]:
    """Every rank loads its slices, shard files from the writers' memory first (counted into
    ``sources``); then all agree (collective) on the slowest load and on the versions any rank
    found corrupt (empty: the load succeeded everywhere)."""
    mine: tuple[str, str] | None = None
    started = time.monotonic()
    store, opened = memory_first_store(coordinator, records, overlays, needed_spans(train_engine.layout, records))
    try:
        load_composite(train_engine, store, records, overlays=overlays)
    except CorruptShardError as error:  # load_composite took part in the load's collective first
        mine = (error.version_id, str(error))
        logger.error("rank %d: %s", coordinator.rank, error)
    seconds = time.monotonic() - started
    for name, value in opened.to_json().items():
        setattr(sources, name, getattr(sources, name) + value)
    failed, slowest = coordinator.all_max([float(mine is not None), seconds])
    if not failed:
        return slowest, []
    found = {
        version_id: why for entry in coordinator.all_gather(mine) if entry is not None for version_id, why in [entry]
    }
    return slowest, sorted(found.items())


def _summed(coordinator: LocalCoordinator, sources: LoadSources) -> dict[str, float]:
    """Every rank's ``sources``, summed (collective, on the side group)."""
    names = list(sources.to_json())
    totals = coordinator.all_sum([float(getattr(sources, n)) for n in names])
    return dict(zip(names, totals))
