"""Export a run's composite as a DeepSpeed checkpoint: ``world_size`` local ranks
(torch.multiprocessing, gloo on CPU; no Ray) each build the run's engine, load the composite
straight from the store (:func:`layercheck.orchestrator.core.recovery.composite.load_composite`),
move to step ``T`` and call DeepSpeed's own ``save_checkpoint``. The result is an ordinary
DeepSpeed checkpoint directory: the same engine config resumes from it with
``engine.load_checkpoint(DIR)``, and DeepSpeed's ``zero_to_fp32`` reads it. It is DeepSpeed's
format, pickle included: load it only where you would load any DeepSpeed checkpoint.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from layercheck.orchestrator.core.run_config import RunConfig, parse_run_config
from layercheck.orchestrator.local.spawn import RanksFailedError, spawn_ranks
from layercheck.orchestrator.offline.export_dir import publish_tag
from layercheck.orchestrator.offline.export_run import ExportError, writing
from layercheck.orchestrator.store.layer_store import LayerStore
from layercheck.orchestrator.store.manifest import VersionRecord
from layercheck.orchestrator.store.recovery_source import ResolvedPlan
from layercheck.workers.config import EngineConfig

logger = logging.getLogger(__name__)


def deepspeed_tag(step: int) -> str:
    """The checkpoint tag an export at ``step`` is saved under."""
    return f"step{step}"


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
    with writing(out) as staging:  # the ranks write the whole checkpoint there; its tag then moves in
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


def deepspeed_engine_config(engine: EngineConfig) -> EngineConfig:
    """The DeepSpeed engine a run's checkpoint is made for: the run's own, or for an FSDP2 run
    ZeRO-3, which shards as FSDP2 does (the store holds layers, not engine files: either loads it)."""
    if engine.backend == "deepspeed":
        return engine
    return dataclasses.replace(engine, backend="deepspeed", zero_stage=3)


def _rank_main(rank: int, world_size: int, job: _DeepSpeedJob) -> None:
    """One export rank: build the engine, load the composite, seek to ``T``, save."""
    from layercheck.orchestrator.core.recovery.composite import load_composite
    from layercheck.workers.engine import build_engine, seek_step, shutdown

    run = parse_run_config(job.run_json)
    train_engine = build_engine(run.model, run.optim, deepspeed_engine_config(run.engine))
    try:
        load_composite(train_engine, LayerStore.open(job.store_uri, fsync=False), job.records, overlays=job.overlays)
        seek_step(train_engine, job.step)
        train_engine.engine.save_checkpoint(
            job.out, tag=deepspeed_tag(job.step), client_state={"layercheck_export": job.provenance()}
        )
    finally:
        shutdown(train_engine)
