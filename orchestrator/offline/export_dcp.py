"""Export a run's composite as a PyTorch Distributed Checkpoint (DCP) of an FSDP2 model: the way out
of LayerCheck for a torchtitan or FSDP2 user.

``world_size`` local ranks (torch.multiprocessing, gloo on CPU; no Ray) each build the run's model
under ``fully_shard`` (the built-in loop's FSDP2 engine: each decoder layer, then the root, over a
1-D mesh; for a DeepSpeed run too, since the store holds layers, not engine files), load the
composite straight from the store
(:func:`layercheck.orchestrator.core.recovery.composite.load_composite`), move to step ``T`` and
save ``{"model": ..., "optim": ...}`` as ``get_state_dict(model, optimizer)`` gives them (the
optimizer's flattened) with ``torch.distributed.checkpoint.save``:
:func:`layercheck.workers.engines.dcp.save_dcp`, since only the engine adapters import DCP. DCP
records each tensor's global shape and every rank's chunk of it, so ``dcp.load`` reads the
checkpoint into a ``fully_shard`` model at any world size (``docs/export.md`` has the lines). Beside DCP's files, :data:`PROVENANCE_FILE` (JSON)
says which run, step and versions it holds.

It is DCP's format: ``.metadata`` and the non-tensor values (the param groups) are pickled; load it
where you would load any DCP checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from layercheck.orchestrator.core.run_config import RunConfig, parse_run_config
from layercheck.orchestrator.local.spawn import RanksFailedError, spawn_ranks
from layercheck.orchestrator.offline.export_dir import publish
from layercheck.orchestrator.offline.export_run import ExportError, check_empty_dir, writing
from layercheck.orchestrator.store.layer_store import LayerStore
from layercheck.orchestrator.store.manifest import VersionRecord
from layercheck.orchestrator.store.recovery_source import ResolvedPlan
from layercheck.workers.config import EngineConfig

logger = logging.getLogger(__name__)

#: The JSON file beside DCP's, naming the run, the step and the versions exported.
PROVENANCE_FILE = "layercheck_export.json"


def export_dcp(
    run: RunConfig, store: LayerStore, resolved: ResolvedPlan, out: Path, world_size: int, *, timeout_s: float = 3600.0
) -> Path:
    """Write the composite as a DCP checkpoint of the run's model under ``fully_shard`` with its
    optimizer (the built-in loop's AdamW and param groups, at step ``T``'s learning rate), saved by
    ``world_size`` ranks, at ``out`` (new or empty). Returns ``out``."""
    if world_size < 1:
        raise ExportError(f"--world-size must be >= 1, got {world_size}")
    check_empty_dir(out, "a DCP export")
    step = resolved.plan.t_fail
    with writing(out) as staging:
        job = _DCPJob(
            run_json=run.to_json(),
            store_uri=store.uri,
            records=dict(resolved.records),
            overlays=dict(resolved.overlays),
            step=step,
            out=str(staging),
        )
        _spawn(job, world_size, timeout_s)
        (staging / PROVENANCE_FILE).write_text(json.dumps(job.provenance(world_size), indent=1))
        publish(staging, out)
    logger.info("wrote the composite at step %d as a DCP checkpoint (saved by %d ranks) to %s", step, world_size, out)
    return out


def fsdp2_engine_config(engine: EngineConfig) -> EngineConfig:
    """The FSDP2 engine a run's DCP checkpoint is made from: the run's own, or for a DeepSpeed
    run the same precision and batch shape under ``fully_shard`` (the store holds layers, not
    engine files: either engine loads it)."""
    if engine.backend == "fsdp2":
        return engine
    return dataclasses.replace(engine, backend="fsdp2", zero_stage=3, extra_ds_config={})


@dataclass(frozen=True, kw_only=True)
class _DCPJob:
    """What every export rank needs; plain values, so it pickles into the spawned processes."""

    run_json: dict[str, Any]
    store_uri: str
    records: dict[str, VersionRecord]
    step: int
    out: str
    overlays: dict[str, tuple[VersionRecord, ...]] = field(default_factory=dict)

    def provenance(self, world_size: int) -> dict[str, Any]:
        return {
            "format": "torch.distributed.checkpoint",
            "state_dict_keys": ["model", "optim"],
            "state_dict_options": {"flatten_optimizer_state_dict": True},
            "saved_by_ranks": world_size,
            "run": self.run_json.get("name"),
            "store": self.store_uri,
            "step": self.step,
            "versions": {layer: r.version_id for layer, r in self.records.items()},
            "partial_versions": {layer: [r.version_id for r in rs] for layer, rs in self.overlays.items()},
        }


def _spawn(job: _DCPJob, world_size: int, timeout_s: float) -> None:
    """Run :func:`_rank_main` on ``world_size`` local processes; :class:`ExportError` naming the
    failing rank if one fails, or the ranks still running after ``timeout_s`` (then killed)."""
    what = f"DCP export of run {job.store_uri} at step {job.step}"
    try:
        spawn_ranks(_rank_main, world_size, job, timeout_s=timeout_s, what=what)
    except RanksFailedError as error:
        raise ExportError(str(error)) from None


def _rank_main(rank: int, world_size: int, job: _DCPJob) -> None:
    """One export rank: build the FSDP2 engine, load the composite, seek to ``T``, save with DCP."""
    from layercheck.orchestrator.core.recovery.composite import load_composite
    from layercheck.workers.engine import build_engine, seek_step, shutdown
    from layercheck.workers.engines.dcp import save_dcp

    run = parse_run_config(job.run_json)
    train_engine = build_engine(run.model, run.optim, fsdp2_engine_config(run.engine))
    try:
        load_composite(train_engine, LayerStore.open(job.store_uri, fsync=False), job.records, overlays=job.overlays)
        seek_step(train_engine, job.step)  # the param groups' learning rate at T, as the run had it
        save_dcp(train_engine.engine, train_engine.optimizer, job.out)
    finally:
        shutdown(train_engine)
