"""What an export exports: the run's store and config, the composite at the step asked for
(every version checked byte by byte, fitted to the run's model), and the output directory it is
written into whole or not at all (``export_dir.py``). The formats (:mod:`.export_hf`,
:mod:`.export_peft`, :mod:`.export_deepspeed`) build on it; :mod:`.exporter` is the command.

The run's config comes from ``run.json`` in the store root (written by ``layercheck train``),
from ``model.json`` (a user's own loop), or from a run file named explicitly.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Iterator, Mapping
from pathlib import Path

from layercheck.orchestrator.core.recovery.composite import CompositeMismatchError, check_fits
from layercheck.orchestrator.core.run_config import RunConfig, load_run_config, parse_run_config
from layercheck.orchestrator.offline.export_dir import staging_dir
from layercheck.orchestrator.store.composite_reader import CompositeReader
from layercheck.orchestrator.store.errors import ManifestError, StoreUnavailableError
from layercheck.orchestrator.store.layer_store import RUN_CONFIG_FILE, LayerStore
from layercheck.orchestrator.store.manifest import VersionRecord
from layercheck.orchestrator.store.model_record import MODEL_FILE, ModelRecord, read_model_record
from layercheck.orchestrator.store.recovery_source import ResolvedPlan, resolve_plan
from layercheck.policies.layer_map import LayerMap
from layercheck.policies.plan import NoUsableVersionError, newest_recoverable_step
from layercheck.workers.config import ModelConfig

logger = logging.getLogger(__name__)


class ExportError(RuntimeError):
    """An export cannot be made; the message names the run and what is missing."""


def open_run(uri: str) -> LayerStore:
    """The store of run ``uri``; :class:`ExportError` if it holds no committed version."""
    store = LayerStore.open(uri, fsync=False)
    try:
        manifest = store.manifest()
    except StoreUnavailableError as error:  # it names the store (never its credentials) and the cause
        raise ExportError(str(error)) from error
    except OSError as error:
        raise ExportError(f"cannot read run {store.uri}: {error}") from error
    if not manifest.records:
        raise ExportError(f"run {store.uri} holds no committed layer versions: nothing to export")
    return store


def run_config_of(store: LayerStore, config_path: str | os.PathLike[str] | None = None) -> RunConfig:
    """The run's config: ``config_path`` if given, else ``run.json`` in the store root (a
    ``layercheck train`` run), else what ``model.json`` records (a user's own loop: the model
    config; the engine settings and the data are the defaults)."""
    if config_path is not None:
        return load_run_config(config_path)
    try:
        text = store.fs.read_bytes(RUN_CONFIG_FILE)
    except FileNotFoundError:
        own = _own_loop_config(store)
        if own is not None:
            return own
        raise ExportError(
            f"run {store.uri} has no {RUN_CONFIG_FILE} nor {MODEL_FILE} (a run written before the driver kept "
            f"them, or an own loop whose model= was no transformers config): pass the run's config file "
            f"with --config FILE"
        ) from None
    try:
        return parse_run_config(json.loads(text))
    except (ValueError, TypeError) as error:  # bad JSON, or a ConfigError naming the field
        raise ExportError(
            f"run {store.uri}: {RUN_CONFIG_FILE} is not a valid run config ({error}); "
            f"pass the run's config file with --config FILE"
        ) from error


def _own_loop_config(store: LayerStore) -> RunConfig | None:
    """The model ``model.json`` records; its tokenizer is :func:`.export_tokenizer.recorded_tokenizer`'s."""
    record = stored_model_record(store)
    if record is None:
        return None
    return RunConfig(name="export", model=ModelConfig(hf_config=record.hf_config))


def stored_model_record(store: LayerStore) -> ModelRecord | None:
    """The store's ``model.json`` (an own loop's run), or ``None``; :class:`ExportError` naming it if damaged."""
    try:
        return read_model_record(store.fs)
    except ManifestError as error:
        raise ExportError(f"{error}; pass the run's config file with --config FILE") from None


def plan_export(store: LayerStore, layer_numel: Mapping[str, int], step: int | None) -> ResolvedPlan:
    """The composite at ``step`` (default: the newest recoverable step), every version checked
    byte by byte; :class:`ExportError` naming the run, the step and the layers without one."""
    if step is not None:
        newest = newest_recoverable_step(list(layer_numel), store.manifest().refs())
        if newest is not None and step > newest:  # the composite would be older than its label
            raise ExportError(
                f"run {store.uri}: --step {step} is past the newest recoverable step {newest}; "
                f"export --step {newest} (or leave --step out)"
            )
    try:
        resolved = resolve_plan(store, layer_numel, step, deep=True)
    except NoUsableVersionError as error:
        at = "the newest recoverable step" if step is None else f"step {step}"
        raise ExportError(f"run {store.uri}: no usable version of every layer at {at}: {error}") from error
    plan = resolved.plan
    logger.info(
        "composite of %s at step %d: %d layers (%d with survivors' captures or other partial versions "
        "overlaid), max staleness %d, %d version(s) skipped as unusable",
        store.uri,
        plan.t_fail,
        len(plan.choices),
        len(resolved.overlays),
        plan.max_staleness,
        len(resolved.skipped),
    )
    return resolved


def check_composite_fits(
    store: LayerStore,
    records: Mapping[str, VersionRecord],
    layer_map: LayerMap,
    *,
    overlays: Mapping[str, tuple[VersionRecord, ...]] | None = None,
) -> None:
    """:class:`ExportError` unless the composite fits the run config's model (see
    :func:`layercheck.orchestrator.core.recovery.composite.check_fits`)."""
    records = {layer: r for layer, r in records.items() if not r.is_initial}  # the model's own: it fits
    with CompositeReader(store, records, overlays=overlays) as read:
        try:
            check_fits(read, records, layer_map)
        except CompositeMismatchError as error:
            raise ExportError(f"run {store.uri}: {error}; wrong --config?") from None


def check_empty_dir(out: Path, what: str) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(f"{out} already exists and is not an empty directory; {what} needs a fresh one")


@contextlib.contextmanager
def writing(out: Path) -> Iterator[Path]:
    """Where to write an export to ``out``: a temporary sibling the block renames into place once
    complete (``export_dir.py``: ``out`` is whole or absent, whatever stops the export); an
    ``OSError`` of the block as :class:`ExportError` naming ``out``."""
    try:
        with staging_dir(out) as staging:
            yield staging
    except OSError as error:
        raise ExportError(f"cannot write the export to {out}: {error}") from error
