"""Export the composite of a run at one step as a checkpoint other tools load.

* **DeepSpeed** (:func:`export_deepspeed`): ``world_size`` local ranks (torch.multiprocessing,
  gloo on CPU; no Ray) each build the run's engine, load the composite straight from the store
  (:func:`layercheck.orchestrator.core.recovery.composite.load_composite`), move to step ``T`` and call DeepSpeed's own
  ``save_checkpoint``. The result is an ordinary DeepSpeed checkpoint directory: the same
  engine config resumes from it with ``engine.load_checkpoint(DIR)``, and DeepSpeed's
  ``zero_to_fp32`` reads it. It is DeepSpeed's format, pickle included: load it only where you
  would load any DeepSpeed checkpoint.
* **Hugging Face** (:func:`export_hf`): the model built from the run's model config on the host,
  every parameter filled with its composite fp32 weights, written with ``save_pretrained``
  (config + safetensors). No DeepSpeed, no process group.

The run's config comes from ``run.json`` in the store root (written by ``layercheck train``),
or from a run file named explicitly.

Every format is written into a temporary sibling of the output directory and renamed into place
once complete (``export_dir.py``): an export that fails or is killed midway leaves no output that
looks like a checkpoint, and the next export to the same place clears what a killed one left.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from layercheck.orchestrator.core.recovery.composite import CompositeMismatchError, check_fits
from layercheck.orchestrator.core.run_config import RunConfig, load_run_config, parse_run_config
from layercheck.orchestrator.local.spawn import RanksFailedError, spawn_ranks
from layercheck.orchestrator.offline.export_dir import publish, publish_tag, staging_dir
from layercheck.orchestrator.store.composite_reader import CompositeReader
from layercheck.orchestrator.store.errors import ManifestError, StoreUnavailableError
from layercheck.orchestrator.store.layer_store import RUN_CONFIG_FILE, LayerStore
from layercheck.orchestrator.store.manifest import VersionRecord
from layercheck.orchestrator.store.model_record import MODEL_FILE, ModelRecord, read_model_record
from layercheck.orchestrator.store.recovery_source import ResolvedPlan, resolve_plan
from layercheck.policies.layer_map import LayerMap
from layercheck.policies.plan import NoUsableVersionError, newest_recoverable_step
from layercheck.workers.config import ModelConfig
from layercheck.workers.data.config import DataConfig
from layercheck.workers.engine import layer_map_for

if TYPE_CHECKING:
    from transformers import PreTrainedModel

logger = logging.getLogger(__name__)

FORMATS: tuple[str, ...] = ("deepspeed", "hf")


class ExportError(RuntimeError):
    """An export cannot be made; the message names the run and what is missing."""


def deepspeed_tag(step: int) -> str:
    """The checkpoint tag an export at ``step`` is saved under."""
    return f"step{step}"


# ---- what to export -------------------------------------------------------------------------
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
    config and the tokenizer; the engine settings are the defaults)."""
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
    record = _model_record(store)
    if record is None:
        return None
    return RunConfig(
        name="export",
        model=ModelConfig(hf_config=record.hf_config),
        data=DataConfig(tokenizer=_tokenizer_of(record, store)),
    )


def _model_record(store: LayerStore) -> ModelRecord | None:
    """The store's ``model.json`` (an own loop's run), or ``None``; :class:`ExportError` naming it if damaged."""
    try:
        return read_model_record(store.fs)
    except ManifestError as error:
        raise ExportError(f"{error}; pass the run's config file with --config FILE") from None


def _tokenizer_of(record: ModelRecord, store: LayerStore) -> str:
    """The tokenizer ``record`` names; ``bytes`` (none) when it names none, which is said plainly."""
    if record.tokenizer is None:
        logger.warning(
            "run %s named no tokenizer (CheckpointConfig(tokenizer=...)): the export holds the model only",
            store.uri,
        )
        return "bytes"
    return record.tokenizer


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


def _check_empty_dir(out: Path, what: str) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(f"{out} already exists and is not an empty directory; {what} needs a fresh one")


@contextlib.contextmanager
def _writing(out: Path) -> Iterator[Path]:
    """Where to write an export to ``out``: a temporary sibling the block renames into place once
    complete (``export_dir.py``: ``out`` is whole or absent, whatever stops the export); an
    ``OSError`` of the block as :class:`ExportError` naming ``out``."""
    try:
        with staging_dir(out) as staging:
            yield staging
    except OSError as error:
        raise ExportError(f"cannot write the export to {out}: {error}") from error


# ---- Hugging Face -----------------------------------------------------------------------------
def composite_model(
    run: RunConfig,
    store: LayerStore,
    records: Mapping[str, VersionRecord],
    *,
    overlays: Mapping[str, tuple[VersionRecord, ...]] | None = None,
) -> PreTrainedModel:
    """The run's model on the host in fp32, every trainable parameter set to its composite fp32
    weights (each element from the newest of ``overlays`` holding it, else from ``records``). A tied output head shares the embedding's tensor, so it is set with it. A frozen
    layer (``model.freeze``) keeps the weights the model is built with: they never changed."""
    from layercheck.workers.engine import build_model

    model = build_model(run.model)
    fill_from_composite(model, layer_map_for(run.model), store, records, overlays=overlays)
    return model


def fill_from_composite(
    model: Any,
    layer_map: LayerMap,
    store: LayerStore,
    records: Mapping[str, VersionRecord],
    *,
    overlays: Mapping[str, tuple[VersionRecord, ...]] | None = None,
) -> None:
    """Set every trainable parameter of the host ``model`` (``layer_map``'s) to its composite fp32
    weights; a layer from the run's initial state keeps the weights ``model`` was built with."""
    # a tied tensor appears once, under its first name
    params = {name: p for name, p in model.named_parameters() if p.requires_grad}
    # a layer from the run's initial state (never saved by then) keeps what build_model made: the
    # engine's initial weights came from the same seeded build; under partial versions it is their base
    initial = {layer for layer, record in records.items() if record.is_initial}
    bases = {
        layer: _ModelBase(model, [p.name for p in layer_map[layer].params])
        for layer in initial
        if (overlays or {}).get(layer)
    }
    keep = {p.name for layer in initial - set(bases) for p in layer_map[layer].params}
    records = {layer: r for layer, r in records.items() if not r.is_initial or layer in bases}
    with CompositeReader(store, records, overlays=overlays, bases=bases) as read, torch.no_grad():
        for name, param in params.items():
            if name in keep:
                continue
            try:
                values = read(name, "fp32", 0, param.numel())
            except (KeyError, ValueError) as error:
                raise ExportError(
                    f"run {store.uri}: the composite has no full fp32 weights of {name!r}: {error}"
                ) from error
            param.copy_(values.view(param.shape))


class _ModelBase:
    """A layer's whole version read from a host model's own weights (zero moments): the run's
    initial state, as ``build_model`` makes it, under a partial version."""

    def __init__(self, model: Any, names: list[str]) -> None:
        own = dict(model.named_parameters())
        self._flat = {name: own[name].detach().reshape(-1).clone() for name in names}
        self.param_shapes = {name: tuple(own[name].shape) for name in names}
        self.optimizer_step = 0
        self.groups: tuple[dict[str, Any], ...] = ()

    def read(self, param: str, key: str, offset: int, length: int) -> torch.Tensor:
        flat = self._flat[param]
        if key != "fp32":
            return torch.zeros(length, dtype=torch.float32)
        return flat.narrow(0, offset, length).clone()

    def close(self) -> None:
        pass


def export_hf(run: RunConfig, store: LayerStore, resolved: ResolvedPlan, out: Path) -> Path:
    """Write the composite as a Hugging Face model folder (config + safetensors) at ``out``."""
    _check_empty_dir(out, "a Hugging Face export")
    tokenizer = run_tokenizer(run)  # before anything is written: a missing tokenizer fails the export
    model = composite_model(run, store, resolved.records, overlays=resolved.overlays)
    with _writing(out) as staging:
        model.save_pretrained(str(staging))
        if tokenizer is not None:
            tokenizer.save_pretrained(str(staging))
        publish(staging, out)
    logger.info("wrote the composite at step %d as a Hugging Face model to %s", resolved.plan.t_fail, out)
    return out


def run_tokenizer(run: RunConfig) -> Any:
    """The tokenizer the run trained with (``data.tokenizer``), to ship beside the model so that
    ``AutoTokenizer.from_pretrained(OUT)`` works; None for byte tokens (there is none)."""
    return tokenizer_named(run.data.tokenizer)


def tokenizer_named(name: str) -> Any:
    """The tokenizer ``name`` (a local directory; ``bytes``: none); :class:`ExportError` if it
    cannot be loaded, before anything is written."""
    from layercheck.workers.data.sft import load_tokenizer

    if name == "bytes":
        logger.info("the run trained on byte tokens (data.tokenizer = 'bytes'): no tokenizer to export")
        return None
    try:
        return load_tokenizer(name)
    except ValueError as error:  # DataError names data.tokenizer and the cause
        raise ExportError(f"the run's tokenizer is needed beside the model: {error}") from None


# ---- a peft adapter ---------------------------------------------------------------------------
def _adapter_record(store: LayerStore) -> ModelRecord | None:
    """The store's model record if the run trained a peft adapter and has no run.json."""
    if store.fs.info(RUN_CONFIG_FILE).is_file:
        return None
    record = _model_record(store)
    return record if record is not None and record.peft is not None else None


def adapter_model(record: ModelRecord, *, merge: bool) -> Any:
    """The run's peft model on the host in fp32: its base built from the recorded config (any
    weights: only the adapter is exported) or, to ``merge``, loaded from ``record.base_model``."""
    import peft
    import transformers

    from layercheck.workers.engine import build_model

    base: Any
    if merge:
        if not record.base_model:
            raise ExportError("--merge needs the adapter's base weights, and the run recorded no base model path")
        try:
            base = transformers.AutoModelForCausalLM.from_pretrained(
                record.base_model, dtype=torch.float32, local_files_only=True
            )
        except OSError as error:
            raise ExportError(f"--merge: cannot load the base model {record.base_model!r}: {error}") from None
    else:
        base = build_model(ModelConfig(hf_config=record.hf_config))
    return peft.get_peft_model(base, peft.get_peft_config(dict(record.peft or {})))


def export_adapter(record: ModelRecord, store: LayerStore, step: int | None, out: Path, *, merge: bool) -> Path:
    """Write a peft run's composite as a peft adapter folder (``adapter_config.json`` +
    ``adapter_model.safetensors``, for ``PeftModel.from_pretrained(base, OUT)``) or, with
    ``merge``, as the base model with the adapter merged in (``from_pretrained(OUT)``)."""
    from layercheck.policies.layer_map import layer_map_of

    _check_empty_dir(out, "an adapter export")
    tokenizer = tokenizer_named(_tokenizer_of(record, store))
    model = adapter_model(record, merge=merge)
    layer_map = layer_map_of(model)
    resolved = plan_export(store, layer_map.numel, step)
    check_composite_fits(store, resolved.records, layer_map, overlays=resolved.overlays)
    fill_from_composite(model, layer_map, store, resolved.records, overlays=resolved.overlays)
    written = model.merge_and_unload() if merge else model
    with _writing(out) as staging:
        written.save_pretrained(str(staging))
        if tokenizer is not None:
            tokenizer.save_pretrained(str(staging))
        publish(staging, out)
    what = "the base model with the adapter merged in" if merge else "a peft adapter"
    logger.info("wrote the composite at step %d as %s to %s", resolved.plan.t_fail, what, out)
    return out


# ---- DeepSpeed --------------------------------------------------------------------------------
def export_deepspeed(
    run: RunConfig, store: LayerStore, resolved: ResolvedPlan, out: Path, world_size: int, *, timeout_s: float = 3600.0
) -> Path:
    """Write the composite as a DeepSpeed checkpoint (tag ``step{T}``) for ``world_size`` ranks at
    ``out``; the run's ZeRO stage and precision. Returns the tag's directory."""
    if world_size < 1:
        raise ExportError(f"--world-size must be >= 1, got {world_size}")
    step = resolved.plan.t_fail
    tag_dir = out / deepspeed_tag(step)
    if tag_dir.exists():
        raise ExportError(f"{tag_dir} already exists; export into another directory or delete it")
    if out.exists() and not out.is_dir():
        raise ExportError(f"{out} exists and is not a directory; a DeepSpeed export writes a checkpoint directory")
    with _writing(out) as staging:  # the ranks write the whole checkpoint there; its tag then moves in
        job = _DeepSpeedJob(
            run_json=run.to_json(),
            store_uri=store.uri,
            records=dict(resolved.records),
            overlays=dict(resolved.overlays),
            step=step,
            out=str(staging),
        )
        _spawn(job, world_size, timeout_s)
        publish_tag(staging, out, deepspeed_tag(step))
    logger.info("wrote the composite at step %d as a %d-rank DeepSpeed checkpoint to %s", step, world_size, tag_dir)
    return tag_dir


@dataclass(frozen=True, kw_only=True)
class _DeepSpeedJob:
    """What every export rank needs; plain values, so it pickles into the spawned processes."""

    run_json: dict[str, Any]
    store_uri: str
    records: dict[str, VersionRecord]
    step: int
    out: str
    overlays: dict[str, tuple[VersionRecord, ...]] = field(default_factory=dict)

    def provenance(self) -> dict[str, Any]:
        return {
            "run": self.run_json.get("name"),
            "store": self.store_uri,
            "step": self.step,
            "versions": {layer: r.version_id for layer, r in self.records.items()},
            "partial_versions": {layer: [r.version_id for r in rs] for layer, rs in self.overlays.items()},
        }


def _spawn(job: _DeepSpeedJob, world_size: int, timeout_s: float) -> None:
    """Run :func:`_rank_main` on ``world_size`` local processes; :class:`ExportError` naming the
    failing rank if one fails, or the ranks still running after ``timeout_s`` (then killed)."""
    what = f"DeepSpeed export of run {job.store_uri} at step {job.step}"
    try:
        spawn_ranks(_rank_main, world_size, job, timeout_s=timeout_s, what=what)
    except RanksFailedError as error:
        raise ExportError(str(error)) from None


def _rank_main(rank: int, world_size: int, job: _DeepSpeedJob) -> None:
    """One export rank: build the engine, load the composite, seek to ``T``, save."""
    from layercheck.orchestrator.core.recovery.composite import load_composite
    from layercheck.workers.engine import build_engine, seek_step, shutdown

    run = parse_run_config(job.run_json)
    train_engine = build_engine(run.model, run.optim, run.engine)
    try:
        load_composite(train_engine, LayerStore.open(job.store_uri, fsync=False), job.records, overlays=job.overlays)
        seek_step(train_engine, job.step)
        train_engine.engine.save_checkpoint(
            job.out, tag=deepspeed_tag(job.step), client_state={"layercheck_export": job.provenance()}
        )
    finally:
        shutdown(train_engine)


# ---- the whole command --------------------------------------------------------------------------
def export(
    run_uri: str,
    *,
    fmt: str,
    out: str | os.PathLike[str],
    step: int | None = None,
    world_size: int | None = None,
    config_path: str | os.PathLike[str] | None = None,
    merge: bool = False,
) -> Path:
    """Export run ``run_uri``'s composite at ``step`` in format ``fmt`` to ``out``; the path
    written. ``merge``: a peft adapter's run writes the base model with the adapter merged in."""
    if fmt not in FORMATS:
        raise ExportError(f"format must be one of {FORMATS}, got {fmt!r}")
    store = open_run(run_uri)
    adapter = _adapter_record(store) if config_path is None else None
    if adapter is not None:
        if fmt != "hf":
            raise ExportError(f"run {store.uri} trained a peft adapter: export it with --format hf (and --merge)")
        return export_adapter(adapter, store, step, Path(out), merge=merge)
    if merge:
        raise ExportError(f"--merge is for a run that trained a peft adapter; run {store.uri} trained the model")
    run = run_config_of(store, config_path)
    if fmt == "deepspeed" and config_path is None and not store.fs.info(RUN_CONFIG_FILE).is_file:
        raise ExportError(
            f"run {store.uri} is an own loop's (its {MODEL_FILE} holds the model, not the DeepSpeed engine "
            "settings a DeepSpeed checkpoint is made for): export --format hf, or pass a run config with --config"
        )
    layer_map = layer_map_for(run.model)
    resolved = plan_export(store, layer_map.numel, step)
    check_composite_fits(store, resolved.records, layer_map, overlays=resolved.overlays)
    out = Path(out)
    if fmt == "hf":
        return export_hf(run, store, resolved, out)
    return export_deepspeed(run, store, resolved, out, run.cluster.num_workers if world_size is None else world_size)
