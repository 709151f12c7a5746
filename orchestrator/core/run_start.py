"""Everything the driver checks and prepares before a run may write or start a worker, in the
order that keeps a user's data safe (no Ray here):

1. the config: data, model (``model.path``, ``model_type``), settings that are legal but likely
   wrong (warnings);
2. the storage location (never ``/``, home, the working directory or a parent of it);
3. the store's lease: one owner at a time (``orchestrator/store/lease.py``);
4. ``--resume``: the stored run's model (its layers and sizes, and the config fields that shape
   the state: ``run.json``, else an own loop's ``model.json``); a composite in which every layer
   has a usable version, at a step below ``steps`` — else an error naming the layer and the options;
   a fresh run: an empty store, or ``--overwrite``, which deletes only what LayerCheck wrote;
5. ``run.json``.

Nothing is deleted or written before steps 1–3 pass.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from layercheck.orchestrator.core.run_checks import check_data, check_model
from layercheck.orchestrator.core.run_config import RunConfig, config_warnings, parse_run_config
from layercheck.orchestrator.store.errors import ManifestError
from layercheck.orchestrator.store.fs import StoreFS
from layercheck.orchestrator.store.initial_state import record_initial
from layercheck.orchestrator.store.layer_store import PREVIOUS_RUN_CONFIG_FILE, RUN_CONFIG_FILE, LayerStore
from layercheck.orchestrator.store.lease import LEASE_FILE, StoreLease
from layercheck.orchestrator.store.model_identity import identity_changes, model_identity, recorded_identity
from layercheck.orchestrator.store.model_record import MODEL_FILE, read_model_record
from layercheck.orchestrator.store.recovery_source import ResolvedPlan, resolve_plan
from layercheck.orchestrator.store.run_dir import check_run_location, clear_run
from layercheck.orchestrator.store.uri import redact_uri
from layercheck.policies.config_loader import ConfigError
from layercheck.policies.layer_map import describe_layers
from layercheck.policies.plan import NoUsableVersionError
from layercheck.workers.config import ModelConfig

logger = logging.getLogger(__name__)


class ResumeError(RuntimeError):
    """``--resume`` cannot continue the run in the store (a layer has no usable version, or the
    config's model is not the stored run's)."""


@dataclass(frozen=True, kw_only=True)
class StartOptions:
    overwrite: bool = False
    """Delete what an earlier run wrote in the storage (only that) before starting."""
    resume: bool = False
    """Continue the run in the storage from its newest recoverable step."""
    take_over: bool = False
    """Take the store's lease even if another process holds it (the operator knows it is dead)."""

    def __post_init__(self) -> None:
        if self.overwrite and self.resume:
            raise ConfigError("--overwrite and --resume: pick one (overwrite deletes what resume would continue)")


def check_config(config: RunConfig) -> dict[str, int]:
    """Step 1: the data and the model, on the driver; the model's layer sizes. Raises ConfigError."""
    logger.info("%s", check_data(config).describe())
    layer_numel = check_model(config.model).numel
    for warning in config_warnings(config):
        logger.warning("%s", warning)
    return layer_numel


def open_run_store(
    config: RunConfig,
    options: StartOptions,
    *,
    layer_numel: dict[str, int] | None = None,
    before_write: Callable[[], None] | None = None,
) -> StoreLease:
    """Steps 1–5 (step 1 unless ``layer_numel`` is given); the store's lease, renewed until
    :meth:`StoreLease.release`. ``config`` must have absolute paths (``with_absolute_storage``).
    ``before_write`` (the driver: join Ray, check the storage suits the cluster) runs once the
    read-only checks have passed (location, an existing run, ``--resume``'s composite) and before
    the lease, so a refused start costs no cluster and writes nothing."""
    if layer_numel is None:
        layer_numel = check_config(config)
    if before_write is not None:
        fs = StoreFS.open(config.storage_uri)
        check_run_location(fs)
        store = LayerStore(fs)
        _refuse_existing_run(store, options)
        if options.resume:
            check_resumable(store, layer_numel, config)
        before_write()

    def prepare(store: LayerStore) -> None:
        if options.resume:
            check_resumable(store, layer_numel, config)
        # the run's config beside its checkpoints: export, inspect and --resume read the model from
        # it; never the storage URI's credentials (a resume takes them from the user's URI again)
        kept = {**config.to_json(), "storage": redact_uri(config.storage)}
        if options.resume:  # (checked above) the config it resumed from stays beside the new one
            try:
                store.fs.write_bytes(PREVIOUS_RUN_CONFIG_FILE, store.fs.read_bytes(RUN_CONFIG_FILE))
            except FileNotFoundError:
                pass
        store.fs.write_bytes(RUN_CONFIG_FILE, json.dumps(kept, indent=2).encode())
        if not options.resume:
            # every start builds the model from this config and a fresh optimizer: that state is
            # every layer's version at step 0, kept at no write cost (a resume keeps the first run's)
            record_initial(store.fs, layer_numel)

    return claim_store(config.storage_uri, run=config.name, options=options, prepare=prepare, steps=config.steps)


def claim_store(
    uri: str,
    *,
    run: str,
    options: StartOptions,
    prepare: Callable[[LayerStore], None] | None = None,
    steps: int | None = None,
) -> StoreLease:
    """Steps 2–4 for any run, ``layercheck train``'s or a user's own loop's: the location, the
    lease (``steps``: the last step the run may train, if known; a record claiming a later one is
    damaged), then (a fresh run) an empty store or one ``--overwrite`` cleared of what LayerCheck
    wrote, then ``prepare(store)``. The lease is released again if any of it fails."""
    fs = StoreFS.open(uri)
    check_run_location(fs)
    lease = StoreLease.acquire(fs, run=run, take_over=options.take_over, steps=steps)
    try:
        store = LayerStore(fs)
        _refuse_existing_run(store, options)
        if not options.resume and store.versions():
            clear_run(fs, keep=frozenset({LEASE_FILE}))
        if prepare is not None:
            prepare(store)
    except BaseException:
        lease.release()
        raise
    lease.keep_alive()
    return lease


def _refuse_existing_run(store: LayerStore, options: StartOptions) -> None:
    if not options.resume and not options.overwrite and store.versions():
        raise FileExistsError(
            f"{store.uri} already holds a run's checkpoints; pick another storage or "
            "name, resume it with --resume, or pass --overwrite to delete them"
        )


@dataclass(frozen=True, kw_only=True)
class StoredModel:
    """What a store says of the model its run trained."""

    record: str
    """Where it says so: ``run.json`` (the built-in loop), ``model.json`` (an own loop's driver)."""
    layer_numel: dict[str, int] | None
    """The layer sizes of the recorded model; ``None`` where they cannot be rebuilt from the record."""
    identity: dict[str, Any]
    """Its config fields that shape the state (``model_identity.py``); those the record has."""


def check_same_model(store: LayerStore, layer_numel: dict[str, int], identity: Mapping[str, Any]) -> None:
    """:class:`ResumeError` unless the config's model is the stored run's: the same layers, each with
    as many parameters, and the same config fields that shape the state (``identity``, of
    :func:`model_config_identity`: 8 heads of 8 have the sizes of 4 heads of 16). Another model would
    drop layers, load wrong shapes, or load the right shapes into the wrong model (the world size and
    ZeRO stage may change: the composite is resliced). Compared with the stored ``run.json``'s
    model, else an own loop's ``model.json``, else with the layers the manifest holds."""
    stored = _stored_model(store)
    if stored is None or stored.layer_numel is None:
        stored_layers = store.manifest().layers()
        removed, added, resized = [n for n in stored_layers if n not in layer_numel], [], []
    else:
        numel = stored.layer_numel
        removed = [n for n in numel if n not in layer_numel]
        added = [n for n in layer_numel if n not in numel]
        resized = [
            f"{n} {numel[n]:,} -> {layer_numel[n]:,}" for n in numel if n in layer_numel and numel[n] != layer_numel[n]
        ]
    fields = identity_changes(stored.identity, identity) if stored is not None else []
    changes = [
        *([f"model config changed: {', '.join(fields)}"] if fields else []),
        *([f"layers the store has and the model not: {describe_layers(removed)}"] if removed else []),
        *([f"layers the model has and the store not: {describe_layers(added)}"] if added else []),
        *(
            [f"parameters per layer changed: {', '.join(resized[:4])}{' …' if len(resized) > 4 else ''}"]
            if resized
            else []
        ),
    ]
    if changes:
        record = stored.record if stored is not None else RUN_CONFIG_FILE
        raise ResumeError(
            f"--resume refused: the config's model is not the one the run in {store.uri} trained ("
            + "; ".join(changes)
            + f"). Resume with the run's own model settings (its {record}), or start a new run elsewhere: "
            "layercheck train CONFIG --restart-into NEW_STORAGE"
        )


def model_config_identity(model: ModelConfig) -> dict[str, Any]:
    """The config fields of ``model`` that shape its state, as ``transformers`` builds its config
    (defaults filled in); ``{}`` for a ``model.path`` whose ``config.json`` cannot be read."""
    if model.hf_config is not None:
        return recorded_identity(model.hf_config)
    from transformers import AutoConfig

    try:
        return model_identity(AutoConfig.from_pretrained(model.path, local_files_only=True))
    except (OSError, ValueError) as error:  # a stored run's checkpoint folder that has moved since
        logger.info("--resume: no config fields of %s to compare (%s)", model.path, error)
        return {}


def _stored_model(store: LayerStore) -> StoredModel | None:
    """The model the store's ``run.json`` names, else the one an own loop's ``model.json`` records;
    ``None`` without a readable one of either."""
    try:
        stored = parse_run_config(json.loads(store.fs.read_bytes(RUN_CONFIG_FILE)))
    except (FileNotFoundError, ValueError, TypeError) as error:  # ConfigError is a ValueError
        logger.info("--resume: no readable %s (%s)", RUN_CONFIG_FILE, error)
    else:
        try:
            numel: dict[str, int] | None = check_model(stored.model).numel
        except (ValueError, TypeError) as error:  # ConfigError: e.g. its model.path has moved
            logger.info("--resume: comparing the model with the manifest's layers only (%s)", error)
            numel = None
        return StoredModel(record=RUN_CONFIG_FILE, layer_numel=numel, identity=model_config_identity(stored.model))
    try:
        record = read_model_record(store.fs)
    except ManifestError as error:
        logger.warning("--resume: %s is not compared with (%s)", MODEL_FILE, error)
        return None
    if record is None:
        return None
    # an own loop's layers may follow its own layer map: compared with the manifest's, not rebuilt
    return StoredModel(record=MODEL_FILE, layer_numel=None, identity=recorded_identity(record.hf_config))


def check_resumable(store: LayerStore, layer_numel: dict[str, int], config: RunConfig) -> ResolvedPlan:
    """The composite ``--resume`` would load, every layer's version checked (files, sizes,
    headers); :class:`ResumeError` naming the layers without one and the options, or
    :class:`ConfigError` when the stored run is already at ``steps``."""
    if not store.versions():
        raise FileNotFoundError(f"--resume: {store.uri} holds no committed versions to resume from")
    check_same_model(store, layer_numel, model_config_identity(config.model))
    try:
        resolved = resolve_plan(store, layer_numel, deep=False)
    except NoUsableVersionError as error:
        raise ResumeError(
            f"--resume refused: {error}.\nThe run cannot continue from this store. Options: restore the "
            "missing or damaged files (layercheck verify shows which) and resume again; or start over from "
            "the initial weights in a new store, keeping this one for inspection: layercheck train CONFIG "
            "--restart-into NEW_STORAGE"
        ) from None
    step = resolved.plan.t_fail
    initial = [layer for layer, record in resolved.records.items() if record.is_initial]
    if initial:
        logger.warning(
            "--resume: %s from the initial state (no usable stored version at or before step %d)",
            describe_layers(initial),
            step,
        )
    if step >= config.steps:
        raise ConfigError(
            f"steps: the run in {store.uri} is already at step {step}, so --resume with steps = "
            f"{config.steps} would train nothing; raise steps above {step} "
            f"(e.g. --set steps={step + config.steps})"
        )
    logger.info(
        "--resume: every layer has a usable version (%d with partial versions overlaid, %d partial passed over); "
        "continuing at step %d of %d",
        len(resolved.overlays),
        len(resolved.plan.passed_over),
        step + 1,
        config.steps,
    )
    return resolved
