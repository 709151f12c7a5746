"""Carrying out a :class:`~layercheck.orchestrator.core.recovery.events.PlanComposite` against a store:
the one piece of recovery that reads storage, shared by every runtime shell."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Mapping, Sequence

from layercheck.orchestrator.core.recovery.events import CompositePlanned, NoComposite, PlanComposite
from layercheck.orchestrator.store.layer_store import LayerStore
from layercheck.orchestrator.store.manifest import Manifest, VersionRecord
from layercheck.orchestrator.store.recovery_source import resolve_plan
from layercheck.policies.plan import NoUsableVersionError, newest_recoverable_step

logger = logging.getLogger(__name__)


def plan_composite(
    store: LayerStore,
    layer_numel: Mapping[str, int],
    action: PlanComposite,
    *,
    clock: Callable[[], float] = time.monotonic,
    memory: Sequence[VersionRecord] = (),
    held: Collection[str] | None = None,
    manifest: Manifest | None = None,
) -> CompositePlanned | NoComposite:
    """The composite at ``action.t_fail`` (``None``: the newest step the store's usable versions
    reach, a ``--resume``'s; a version found unusable never sets it), or why
    there is none, stamped with ``clock()`` when planning ended. ``memory``: the writers' memory
    versions, weighed with the stored ones; ``held``: the files the live writers hold (``None``:
    not known, every memory version counts as held); ``manifest``: the committed versions as the
    caller knows them (``known_versions.py``; ``None``: read the store's)."""
    try:
        resolved = resolve_plan(
            store,
            layer_numel,
            action.t_fail,
            deep=False,
            skip=action.skip,
            memory=memory,
            held=held,
            manifest=manifest,
        )
    except NoUsableVersionError as error:
        t_fail = action.t_fail
        if t_fail is None:
            t_fail = newest_recoverable_step(list(layer_numel), (manifest or store.manifest()).refs()) or 0
        return NoComposite(attempt=action.attempt, t_fail=t_fail, reason=str(error), now=clock())
    return CompositePlanned(
        attempt=action.attempt,
        t_fail=resolved.plan.t_fail,
        records=dict(resolved.records),
        max_staleness=resolved.plan.max_staleness,
        weighted_staleness=resolved.plan.weighted_staleness,
        now=clock(),
        overlays=dict(resolved.overlays),
        sources=resolved.sources,
    )
