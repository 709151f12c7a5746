"""Export the composite of a run that trained a peft (LoRA) adapter: the adapter in peft's format
(``PeftModel.from_pretrained(base, OUT)``) or, with ``merge``, the base model with the adapter
merged in. The run has no ``run.json``; its ``model.json`` records the base config and the adapter.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from layercheck.orchestrator.offline.export_dir import publish
from layercheck.orchestrator.offline.export_hf import fill_from_composite
from layercheck.orchestrator.offline.export_run import (
    ExportError,
    check_composite_fits,
    check_empty_dir,
    plan_export,
    stored_model_record,
    writing,
)
from layercheck.orchestrator.offline.export_tokenizer import recorded_tokenizer
from layercheck.orchestrator.store.layer_store import RUN_CONFIG_FILE, LayerStore
from layercheck.orchestrator.store.model_record import ModelRecord
from layercheck.workers.config import ModelConfig

if TYPE_CHECKING:
    from peft import PeftModel
    from transformers import PreTrainedModel

logger = logging.getLogger(__name__)


def adapter_record(store: LayerStore) -> ModelRecord | None:
    """The store's model record if the run trained a peft adapter and has no run.json."""
    if store.fs.info(RUN_CONFIG_FILE).is_file:
        return None
    record = stored_model_record(store)
    return record if record is not None and record.peft is not None else None


def adapter_model(record: ModelRecord, *, merge: bool) -> PeftModel:
    """The run's peft model on the host in fp32: its base built from the recorded config (any
    weights: only the adapter is exported) or, to ``merge``, loaded from ``record.base_model``."""
    import peft
    import transformers

    from layercheck.workers.engine import build_model

    base: PreTrainedModel
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

    check_empty_dir(out, "an adapter export")
    tokenizer = recorded_tokenizer(record, store)
    model = adapter_model(record, merge=merge)
    layer_map = layer_map_of(model)
    resolved = plan_export(store, layer_map.numel, step)
    check_composite_fits(store, resolved.records, layer_map, overlays=resolved.overlays)
    fill_from_composite(model, layer_map, store, resolved.records, overlays=resolved.overlays)
    written = model.merge_and_unload() if merge else model
    with writing(out) as staging:
        written.save_pretrained(str(staging))
        if tokenizer is not None:
            tokenizer.save_pretrained(str(staging))
        publish(staging, out)
    what = "the base model with the adapter merged in" if merge else "a peft adapter"
    logger.info("wrote the composite at step %d as %s to %s", resolved.plan.t_fail, what, out)
    return out
