"""Export the composite of a run at one step as a checkpoint other tools load: ``layercheck export``.

* **DeepSpeed** (:mod:`.export_deepspeed`): the run's engine on ``world_size`` local ranks saves the
  composite with DeepSpeed's own ``save_checkpoint``; the same engine config resumes from it.
* **DCP** (:mod:`.export_dcp`): the run's model under ``fully_shard`` on ``world_size`` local ranks
  saves the composite with ``torch.distributed.checkpoint`` (model and optimizer, as
  ``get_state_dict`` gives them); ``dcp.load`` reads it into an FSDP2 model at any world size.
* **Hugging Face** (:mod:`.export_hf`): the model built on the host, filled with its composite
  fp32 weights, written with ``save_pretrained`` (config + safetensors), beside the run's
  tokenizer (:mod:`.export_tokenizer`).
* **peft** (:mod:`.export_peft`): a run that trained an adapter exports the adapter, or with
  ``merge`` the base model with it merged in.

What is exported (the run's config, the composite, the output directory written whole or not at
all) is :mod:`.export_run`'s; this module picks the format.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from layercheck.orchestrator.offline.export_dcp import export_dcp
from layercheck.orchestrator.offline.export_deepspeed import export_deepspeed
from layercheck.orchestrator.offline.export_hf import export_hf
from layercheck.orchestrator.offline.export_peft import adapter_record, export_adapter
from layercheck.orchestrator.offline.export_run import (
    ExportError,
    check_composite_fits,
    open_run,
    plan_export,
    run_config_of,
    stored_model_record,
)
from layercheck.orchestrator.offline.export_tokenizer import recorded_tokenizer, run_tokenizer
from layercheck.orchestrator.store.layer_store import RUN_CONFIG_FILE
from layercheck.orchestrator.store.model_record import MODEL_FILE
from layercheck.workers.engine import layer_map_for

logger = logging.getLogger(__name__)

FORMATS: tuple[str, ...] = ("deepspeed", "dcp", "hf")
#: The formats written by local ranks, whose count ``world_size`` sets.
RANKED_FORMATS: tuple[str, ...] = ("deepspeed", "dcp")


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
    adapter = adapter_record(store) if config_path is None else None
    if adapter is not None:
        if fmt != "hf":
            raise ExportError(f"run {store.uri} trained a peft adapter: export it with --format hf (and --merge)")
        return export_adapter(adapter, store, step, Path(out), merge=merge)
    if merge:
        raise ExportError(f"--merge is for a run that trained a peft adapter; run {store.uri} trained the model")
    run = run_config_of(store, config_path)
    own_loop = config_path is None and not store.fs.info(RUN_CONFIG_FILE).is_file  # its model.json has the model
    if fmt == "deepspeed" and own_loop:
        raise ExportError(
            f"run {store.uri} is an own loop's (its {MODEL_FILE} holds the model, not the DeepSpeed engine "
            "settings a DeepSpeed checkpoint is made for): export --format hf, or pass a run config with --config"
        )
    if fmt == "dcp" and own_loop:  # its param groups would carry our defaults, which dcp.load puts in the user's
        raise ExportError(
            f"run {store.uri} is an own loop's (its {MODEL_FILE} holds the model, not the optimizer settings "
            "whose param groups a DCP checkpoint carries and dcp.load sets): export --format hf, or pass a run "
            "config with your optimizer's settings with --config"
        )
    layer_map = layer_map_for(run.model)
    resolved = plan_export(store, layer_map.numel, step)
    check_composite_fits(store, resolved.records, layer_map, overlays=resolved.overlays)
    out = Path(out)
    if fmt == "hf":
        record = stored_model_record(store) if own_loop else None
        tokenizer = recorded_tokenizer(record, store) if record is not None else run_tokenizer(run)
        return export_hf(run, store, resolved, out, tokenizer)
    ranks = run.cluster.num_workers if world_size is None else world_size
    if fmt == "dcp":
        return export_dcp(run, store, resolved, out, ranks)
    return export_deepspeed(run, store, resolved, out, ranks)
