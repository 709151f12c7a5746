"""Loading a composite into a live engine: each rank reads only its own slices of the chosen
versions, straight from the store, whatever world size they were written at."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping

from orchestrator.manifest import VersionRecord
from orchestrator.recovery_source import CompositeReader
from orchestrator.store import LayerStore
from workers.engine import TrainEngine
from workers.layer_state import restore_layers

logger = logging.getLogger(__name__)


def load_composite(te: TrainEngine, store: LayerStore, records: Mapping[str, VersionRecord]) -> float:
    """Restore every layer in ``records`` from its version (collective at ZeRO 1-3); seconds taken.

    Raises :class:`~orchestrator.store_errors.CorruptShardError` naming the version if a tensor
    fails its checksum.
    """
    started = time.monotonic()
    with CompositeReader(store, records) as reader:
        restore_layers(te.layout, reader.metas(), reader)
    elapsed = time.monotonic() - started
    logger.info("loaded a composite of %d layers in %.2fs", len(records), elapsed)
    return elapsed
