"""The committed versions as the run's supervisor knows them, so that a recovery's plan reads no
manifest: the store's manifest is read once, when the run starts (a ``--resume`` or a restarted
driver finds its history there), and every version the supervisor commits from then on is added
as it commits it. The supervisor is the run's only committer (``STORE_LAYOUT.md``, one writer per
store), so nothing else adds a version meanwhile.

Why: reading the manifest lists ``manifest/`` whole and reads every commit record (one object per
version): a week-long run's recovery would pay for the run's whole history, in LIST pages and GETs
and seconds (``bench/scale``'s plan over many versions). A version taken away under the run (a
``layercheck gc`` deleting an old one) is still listed here: the plan checks every version it
chooses (files present, sizes, headers) and plans around one that is gone, as around any unusable
one.

Only the versions a plan can choose are kept: each layer's newest :data:`KEPT_PER_LAYER` whole
versions, and the partial ones newer than the oldest of those. A record names every rank's file
(at 1,024 ranks about 200 kB): a week's 10^5 versions would otherwise hold gigabytes here. A plan
that finds every kept version of a layer unusable reads the store's whole history instead
(:attr:`KnownVersions.pruned` says whether any was left out).

Thread-safe: commits come from the supervisor's commit threads while a recovery plans."""

from __future__ import annotations

import logging
import threading

from layercheck.orchestrator.store.layer_store import LayerStore
from layercheck.orchestrator.store.manifest import Manifest, VersionRecord

logger = logging.getLogger(__name__)

#: Whole versions of each layer kept, newest first: a plan falls back this far before it reads the store.
KEPT_PER_LAYER = 4


class KnownVersions:
    def __init__(self, kept_per_layer: int = KEPT_PER_LAYER) -> None:
        self.kept_per_layer = kept_per_layer
        self._lock = threading.Lock()
        self._read: Manifest | None = None
        """The store's manifest as read at the start, less its records (``None``: not read yet)."""
        self._layers: dict[str, dict[str, VersionRecord]] = {}
        """Per layer, the versions a plan can choose (by version id)."""
        self.pruned = False
        """Some version was left out (older than what a plan falls back to)."""

    @property
    def read(self) -> bool:
        with self._lock:
            return self._read is not None

    def load(self, store: LayerStore) -> None:
        """Read the store's manifest, once (later calls do nothing)."""
        with self._lock:
            if self._read is not None:
                return
        manifest = store.manifest()  # (outside the lock: commits are not held up by the read)
        with self._lock:
            if self._read is not None:
                return
            self._read = Manifest(
                records=(),
                problems=manifest.problems,
                claimed=manifest.claimed,
                claims_unknown=manifest.claims_unknown,
                fenced=manifest.fenced,
            )
            for record in manifest.records:  # (a commit that landed while it listed is kept too)
                self._layers.setdefault(record.layer, {}).setdefault(record.version_id, record)
            for layer in list(self._layers):
                self._prune(layer)
        logger.info("the run starts with %d committed version(s) in its store", len(manifest.records))

    def committed(self, record: VersionRecord) -> None:
        """The supervisor committed ``record``."""
        with self._lock:
            self._layers.setdefault(record.layer, {})[record.version_id] = record
            self._prune(record.layer)

    def _prune(self, layer: str) -> None:
        records = self._layers[layer]
        whole = sorted((r for r in records.values() if not r.partial), key=lambda r: r.step, reverse=True)
        if len(whole) <= self.kept_per_layer:
            return
        newest = {r.version_id for r in whole[: self.kept_per_layer]}
        oldest = whole[self.kept_per_layer - 1].step
        kept = {vid: r for vid, r in records.items() if vid in newest or (r.partial and r.step >= oldest)}
        self.pruned = self.pruned or len(kept) < len(records)
        self._layers[layer] = kept

    def manifest(self, store: LayerStore) -> Manifest:
        """The versions a plan can choose: the store's at the start (read now if it was not) and
        every commit since, pruned (see the module), as a :class:`Manifest` (by step, then layer)."""
        self.load(store)
        with self._lock:
            read = self._read
            assert read is not None  # (load set it)
            records = [r for layer in self._layers.values() for r in layer.values()]
        records.sort(key=lambda r: (r.step, r.layer, r.version_id))
        return Manifest(
            records=tuple(records),
            problems=read.problems,
            claimed=read.claimed,
            claims_unknown=read.claims_unknown,
            fenced=read.fenced,
        )
