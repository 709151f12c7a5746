"""Export a run's composite as a Hugging Face model folder: the model built from the run's model
config on the host, every parameter filled with its composite fp32 weights, written with
``save_pretrained`` (config + safetensors) beside the run's tokenizer (:mod:`.export_tokenizer`). No
DeepSpeed, no process group.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from layercheck.orchestrator.core.run_config import RunConfig
from layercheck.orchestrator.offline.export_dir import publish
from layercheck.orchestrator.offline.export_run import ExportError, check_empty_dir, writing
from layercheck.orchestrator.store.composite_reader import CompositeReader
from layercheck.orchestrator.store.layer_store import LayerStore
from layercheck.orchestrator.store.manifest import VersionRecord
from layercheck.orchestrator.store.recovery_source import ResolvedPlan
from layercheck.policies.layer_map import LayerMap
from layercheck.workers.engine import layer_map_for

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from layercheck.orchestrator.offline.export_tokenizer import ShippedTokenizer

logger = logging.getLogger(__name__)


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
    model: torch.nn.Module,
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

    def __init__(self, model: torch.nn.Module, names: list[str]) -> None:
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


def export_hf(
    run: RunConfig, store: LayerStore, resolved: ResolvedPlan, out: Path, tokenizer: ShippedTokenizer | None
) -> Path:
    """Write the composite as a Hugging Face model folder (config + safetensors) at ``out``, with
    ``tokenizer`` (:mod:`.export_tokenizer`: found before anything is written; ``None``: none) beside it."""
    check_empty_dir(out, "a Hugging Face export")
    model = composite_model(run, store, resolved.records, overlays=resolved.overlays)
    with writing(out) as staging:
        model.save_pretrained(str(staging))
        if tokenizer is not None:
            tokenizer.save_pretrained(str(staging))
        publish(staging, out)
    logger.info("wrote the composite at step %d as a Hugging Face model to %s", resolved.plan.t_fail, out)
    return out
