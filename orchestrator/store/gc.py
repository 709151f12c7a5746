"""Garbage collection of a layer store: carries out :func:`layercheck.policies.retention.plan_retention`
and collects orphans.

Never deletes the newest verified fallback of a layer: before deleting any version of a layer
it checksums every version of that layer it keeps; a damaged one is planned around (as if it
did not exist), so what a recovery would fall back to stays.

Safe against a concurrent commit:

* an unreachable version loses its commit record first, then its files — a reader that lists
  the manifest afterwards never sees it half deleted;
* only files LayerCheck's own naming says it wrote are ever candidates (``run_dir.owned_file``:
  shard files and their temporaries in ``layers/<layer>/``, record temporaries in ``manifest/``);
  anything else there (a user's notes, another run nested in this one's tree, a file at a depth
  LayerCheck never writes) is *foreign*: kept, logged and reported, never deleted;
* a file no commit record names (an orphan: its writer crashed, or its commit never came) and
  a leftover ``*.tmp`` are deleted only once older than ``grace_s``: a version being written
  right now is younger than that. The shard files are listed *before* the manifest is read,
  so a version committed in between is still seen as committed;
* a file a damaged commit record names (a newer format, a record damaged after its commit) is
  not an orphan: it is kept and reported, and while a record is not even readable JSON no
  uncommitted file is deleted (what it names cannot be told);
* nothing outside the store is ever deleted: every path passes :meth:`StoreFS.path`'s check.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection
from dataclasses import dataclass, field

from layercheck.orchestrator.store.errors import PathOutsideStoreError
from layercheck.orchestrator.store.fs import TMP_SUFFIX
from layercheck.orchestrator.store.layer_store import LayerStore
from layercheck.orchestrator.store.manifest import LAYERS_DIR, MANIFEST_DIR, Manifest
from layercheck.orchestrator.store.run_dir import owned_file
from layercheck.policies.retention import RetentionConfig, RetentionDecision, plan_retention

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class GcConfig:
    retention: RetentionConfig = field(default_factory=RetentionConfig)
    grace_s: float = 3600.0
    """Uncommitted files younger than this are left alone (a write may be in progress)."""
    dry_run: bool = False
    """Report what would be freed, delete nothing."""

    def __post_init__(self) -> None:
        if not self.grace_s >= 0:
            raise ValueError(f"grace_s must be >= 0 seconds, got {self.grace_s!r}")


@dataclass(frozen=True, kw_only=True)
class GcReport:
    dry_run: bool
    newest_step: int | None
    deleted_versions: tuple[str, ...]
    orphans: tuple[str, ...]
    kept: int
    freed_bytes: int
    errors: tuple[str, ...] = ()
    damaged: dict[str, str] = field(default_factory=dict)
    """Versions found damaged (version id → why): kept, and their fallbacks kept in their place."""
    kept_files: tuple[str, ...] = ()
    """Uncommitted files kept because a damaged commit record may name them (``Manifest.claimed``)."""
    fenced: tuple[str, ...] = ()
    """Versions a superseded run committed after its store was taken over (``epochs.py``):
    never counted by any reader, deleted (listed in ``deleted_versions`` too)."""
    foreign: tuple[str, ...] = ()
    """Files under ``layers/`` and ``manifest/`` that LayerCheck's naming says it did not write
    (``run_dir.owned_file``): a user's, another run's nested here; kept, never deleted."""


_MAX_LOGGED = 5


def _listed(store: LayerStore) -> tuple[list, tuple[str, ...]]:
    """The files GC may collect: shard files and their temporaries under ``layers/``, record
    temporaries under ``manifest/`` (a record itself goes only with its version); and the foreign
    files found there, which it never touches."""
    candidates, foreign = [], []
    for rel, info in store.fs.list_files(LAYERS_DIR, recursive=True) + store.fs.list_files(MANIFEST_DIR):
        if not owned_file(rel):
            foreign.append(rel)
        elif rel.startswith(LAYERS_DIR + "/") or rel.endswith(TMP_SUFFIX):
            candidates.append((rel, info))
    if foreign:
        logger.warning(
            "gc: keeping %d file(s) in %s that LayerCheck did not write (not its naming; never deleted): %s%s",
            len(foreign),
            store.fs.uri(),
            ", ".join(foreign[:_MAX_LOGGED]),
            f" and {len(foreign) - _MAX_LOGGED} more" if len(foreign) > _MAX_LOGGED else "",
        )
    return candidates, tuple(foreign)


def _orphans(
    store: LayerStore, listed: list, referenced: set[str], grace_s: float, now: float
) -> list[tuple[str, int]]:
    out = []
    for rel, info in listed:
        if rel in referenced:
            continue
        if info.mtime is None:
            logger.warning("gc: %s has no modification time; leaving it", store.fs.uri(rel))
            continue
        age = now - info.mtime.timestamp()
        if age >= grace_s:
            out.append((rel, info.size or 0))
        else:
            logger.debug("gc: %s is uncommitted but only %.0fs old; leaving it", rel, age)
    return out


def _verified_plan(
    store: LayerStore, manifest: Manifest, config: GcConfig, layers: list[str]
) -> tuple[RetentionDecision, dict[str, str]]:
    """Plan retention, then checksum every version kept in a layer that loses versions; if one
    is damaged, re-plan without it (its fallback is then kept) until every such version is verified.
    Deleting from a layer thus never removes its newest verified fallback."""
    unusable: dict[str, str] = {}
    verified: set[str] = set()
    by_id = manifest.by_id()
    while True:
        decision = plan_retention(manifest.refs(), config=config.retention, layers=layers, unusable=unusable)
        losing = {by_id[vid].layer for vid in decision.delete}
        fresh = False
        for vid in decision.keep:
            record = by_id[vid]
            if record.layer not in losing or vid in verified or vid in unusable:
                continue
            problems = store.check_version(record, deep=True)
            if problems:
                unusable[vid] = "; ".join(problems)
                fresh = True
                logger.warning(
                    "gc: version %s (layer %s step %d) is damaged (%s): planning as if it did not "
                    "exist, so its fallback is kept",
                    vid,
                    record.layer,
                    record.step,
                    unusable[vid],
                )
            else:
                verified.add(vid)
        if not fresh:
            return decision, unusable


def collect_garbage(
    store: LayerStore, config: GcConfig, *, layers: Collection[str] | None = None, now: float | None = None
) -> GcReport:
    """Delete the versions no recovery point in the window needs, and old orphans."""
    now = time.time() if now is None else now
    listed, foreign = _listed(store)
    manifest = store.manifest()
    decision, unusable = _verified_plan(
        store, manifest, config, list(layers) if layers is not None else list(manifest.layers())
    )
    fenced = [record for record, _ in manifest.fenced]
    doomed = [r for r in manifest.records if r.version_id in decision.delete] + fenced
    referenced = {s.path for r in (*manifest.records, *fenced) for s in r.shards}
    kept_files = tuple(
        rel for rel, _ in listed if rel not in referenced and (manifest.claims_unknown or rel in manifest.claimed)
    )
    if kept_files:
        logger.warning(
            "gc: keeping %d uncommitted file(s) that a damaged commit record %s: %s",
            len(kept_files),
            "may name (one is not readable JSON)" if manifest.claims_unknown else "names",
            "; ".join(manifest.problems),
        )
    orphans = _orphans(store, listed, referenced | set(kept_files), config.grace_s, now)
    freed, errors = 0, []
    for record in doomed:
        logger.info(
            "gc: %s version %s (layer %s step %d): %s",
            "would delete" if config.dry_run else "deleting",
            record.version_id,
            record.layer,
            record.step,
            "fenced out (a superseded run's late commit)"
            if record in fenced
            else "no recovery point in the window needs it",
        )
        if config.dry_run:
            freed += record.nbytes
            continue
        try:
            freed += store.delete_version(record)
        except (OSError, PathOutsideStoreError) as error:  # keep going: the next GC retries a failed deletion
            errors.append(f"{record.version_id}: {error}")
            logger.warning("gc: could not delete version %s: %s", record.version_id, error)
    for rel, size in orphans:
        logger.info(
            "gc: %s orphan %s (%d bytes, never committed)",
            "would delete" if config.dry_run else "deleting",
            store.fs.uri(rel),
            size,
        )
        if config.dry_run:
            freed += size
            continue
        try:
            if store.fs.delete(rel):
                freed += size
        except (OSError, PathOutsideStoreError) as error:
            errors.append(f"{rel}: {error}")
            logger.warning("gc: could not delete orphan %s: %s", store.fs.uri(rel), error)
    return GcReport(
        dry_run=config.dry_run,
        newest_step=decision.newest_step,
        deleted_versions=tuple(r.version_id for r in doomed),
        orphans=tuple(rel for rel, _ in orphans),
        kept=len(decision.keep),
        freed_bytes=freed,
        errors=tuple(errors),
        damaged=unusable,
        kept_files=kept_files,
        fenced=tuple(r.version_id for r in fenced),
        foreign=foreign,
    )
