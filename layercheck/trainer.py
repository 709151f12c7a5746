"""Driver side: Ray Train's ``TorchTrainer`` with LayerCheck's actors around it.

``LayerCheckTrainer`` takes what ``TorchTrainer`` takes (``train_loop_per_worker``,
``train_loop_config``, ``ScalingConfig``, ``RunConfig`` with its ``FailureConfig``) plus the
model (to plan the layers) and a :class:`~layercheck.config.CheckpointConfig`. ``fit()`` starts
the run's policy actor, supervisor and writer pool exactly as ``layercheck train`` does, runs the
trainer (Ray Train restarts a lost worker group; LayerCheck resumes it at ``t_fail + 1``), and
returns the run's summary.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Union

import torch

from layercheck.config import CheckpointConfig
from layercheck.orchestrator.core.run_config import check_relative_storage
from layercheck.orchestrator.core.run_start import StartOptions, claim_store
from layercheck.orchestrator.runtime.cluster import check_shared_storage, connect_to
from layercheck.orchestrator.runtime.context import WorkerContext, with_context
from layercheck.orchestrator.runtime.driver import start_run
from layercheck.orchestrator.runtime.fit_watch import fit_watched
from layercheck.orchestrator.runtime.run_end import RunResult, finish_run
from layercheck.orchestrator.runtime.run_summary import format_summary, summarize
from layercheck.orchestrator.runtime.train_report import with_callbacks
from layercheck.orchestrator.store.fs import StoreFS
from layercheck.orchestrator.store.lease import StoreLease
from layercheck.orchestrator.store.model_record import describe_model, write_model_record
from layercheck.policies.config_loader import ConfigError
from layercheck.policies.layer_map import LayerMap, LayerMapSpec, model_layer_map

if TYPE_CHECKING:
    from ray.train import RunConfig
    from ray.train.torch import TorchConfig
    from transformers import PretrainedConfig

#: What ``LayerCheckTrainer(model=...)`` takes to plan the layers without the weights: a
#: ``transformers`` config, the module, a function returning the module (called on the meta
#: device), or the layer map itself.
PlannedModel = Union["PretrainedConfig", torch.nn.Module, Callable[[], torch.nn.Module], LayerMap]

logger = logging.getLogger(__name__)


@dataclass
class FitResult:
    """What :meth:`LayerCheckTrainer.fit` returns."""

    run: RunResult
    """The run's final state (``run.status``), drift trace and layer sizes."""
    summary: dict[str, object] = field(default_factory=dict)
    """The closing summary ``layercheck train`` prints (failures, recoveries, bytes, ETTR, ...)."""

    @property
    def error(self) -> str | None:
        """Why the run failed for good; ``None`` when it finished."""
        return self.run.error

    @property
    def losses(self) -> dict[int, float]:
        """Rank 0's loss per step, over all attempts (a step redone after a failure: its last loss)."""
        return {
            int(k): float(v[0])
            for k, v in sorted(self.run.status["account"]["history"].items(), key=lambda kv: int(kv[0]))
        }

    def format(self) -> str:
        """The summary as the text table ``layercheck train`` prints."""
        return format_summary(self.summary)


class LayerCheckTrainer:
    """``ray.train.torch.TorchTrainer`` with LayerCheck checkpointing and recovery."""

    def __init__(
        self,
        train_loop_per_worker: Callable[..., object],
        *,
        model: PlannedModel,
        checkpoint: CheckpointConfig,
        scaling_config: Any,  # ray.train.ScalingConfig: see with_spares
        run_config: RunConfig | None = None,
        train_loop_config: dict[str, object] | None = None,
        torch_config: TorchConfig | None = None,
        on_progress: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        """``model``: the model ``train_loop_per_worker`` trains, for the driver to plan its layers
        without its weights: a ``transformers`` config, a function returning the module (called on
        the meta device), the module itself, or a ``LayerMap``. ``run_config`` (``ray.train.RunConfig``)
        carries the ``FailureConfig``; with ``max_failures=0`` a lost worker ends the run.
        ``on_progress`` gets the supervisor's status about once a second."""
        self.train_loop_per_worker = train_loop_per_worker
        self.model = model
        self.checkpoint = checkpoint
        self.scaling_config = scaling_config
        self.run_config = run_config
        self.train_loop_config = train_loop_config
        self.torch_config = torch_config
        self.on_progress = on_progress

    def layer_map(self) -> LayerMap:
        """The layers LayerCheck will track (raises ``UnplacedParameterError`` for a model it
        cannot map: pass ``CheckpointConfig(layer_map=...)``)."""
        return planned_layer_map(self.model, self.checkpoint.layer_map)

    def _connect(self) -> None:
        scaling = self.scaling_config
        workers = scaling.num_workers if isinstance(scaling.num_workers, int) else max(scaling.num_workers)
        workers += self.checkpoint.spares
        connect_to(use_gpu=bool(scaling.use_gpu), cpus=int(workers * (scaling.num_cpus_per_worker or 1)) + 1)

    def fit(self) -> FitResult:
        """Run to the end; a run that fails for good is in ``result.error`` (not raised)."""
        cfg = self.checkpoint
        layers = self.layer_map()  # a bad model fails here, before any actor or worker starts
        if cfg.in_place:
            check_in_place(self.scaling_config, self.torch_config)
        if "://" not in cfg.storage and not os.path.isabs(cfg.storage):
            check_relative_storage(cfg.storage)  # under `ray job submit` Ray deletes the job's directory
        self._connect()
        check_shared_storage(
            cfg.storage_uri, shared=cfg.shared_storage, opt_in="CheckpointConfig(shared_storage=True)"
        )  # before the store is claimed: nothing is written on a refused cluster
        lease = claim_store(
            cfg.storage_uri,
            run=cfg.name,
            options=StartOptions(overwrite=cfg.overwrite),
            prepare=lambda store: self._record_model(store.fs),
        )
        try:
            run = self._fit(cfg, layers, lease)
        finally:
            lease.release(wait_s=cfg.persistence.stop_drain_s)  # a renewal hung on storage is not waited for
        summary = summarize(run)
        if cfg.spares and summary.get("spares") is None:
            summary["spares"] = spares_figures(run.status.get("spares"), self.scaling_config)
        return FitResult(run=run, summary=summary)

    def _record_model(self, fs: StoreFS) -> None:
        """``model.json``: what ``export`` needs of a model LayerCheck did not build."""
        model = self.model
        if callable(model) and not isinstance(model, torch.nn.Module) and not hasattr(model, "to_diff_dict"):
            with torch.device("meta"):
                model = model()  # (a function returning the module, a peft model say: as layer_map does)
        record = describe_model(model)
        if record is None:
            logger.warning(
                "LayerCheck: model= is not a transformers config or model, so the store records no model "
                "config: `layercheck export` of this run needs --config"
            )
            return
        write_model_record(fs, dataclasses.replace(record, tokenizer=self.checkpoint.tokenizer))

    def _fit(self, cfg: CheckpointConfig, layers: LayerMap, lease: StoreLease) -> RunResult:
        from ray.train import FailureConfig, RunConfig

        from layercheck.orchestrator.runtime.ray_trainer import LayerCheckTorchTrainer

        scaling = self.scaling_config
        workers = scaling.num_workers if isinstance(scaling.num_workers, int) else max(scaling.num_workers)
        self._connect()
        assert not isinstance(cfg.policy, str)  # CheckpointConfig resolved the name to its config
        handles = start_run(
            name=cfg.name,
            storage_uri=cfg.storage_uri,
            policy=cfg.policy,
            persistence=cfg.persistence,
            metrics=cfg.metrics,
            num_workers=workers,
            layer_numel=layers.numel,
            lease=lease,
            in_place=cfg.in_place,
            spares=cfg.spares,
            worker_resources={"CPU": scaling.num_cpus_per_worker, "GPU": scaling.num_gpus_per_worker},
        )
        ctx = WorkerContext(
            run_id=handles.run_id,
            storage_uri=cfg.storage_uri,
            fsync=cfg.persistence.fsync,
            max_inflight_bytes=cfg.persistence.max_inflight_bytes,
            fault=cfg.fault,
            drift_probe=cfg.drift_probe,
            layer_map=cfg.layer_map,
            layer_numel=layers.numel,
            save_final=cfg.persistence.save_final,
            capture_timeout_s=cfg.persistence.capture_hand_over_s,
            memory_period=cfg.persistence.memory_period_at_start,
            policy=cfg.policy,
            in_place=cfg.in_place,
            spares=cfg.spares,
            regroup_timeout_s=cfg.regroup_timeout_s,
            stop_drain_s=cfg.persistence.stop_drain_s,
            decision_timeout_s=cfg.persistence.decision_timeout_s,
        )
        loop = with_context(self.train_loop_per_worker, ctx, takes_config=_takes_config(self.train_loop_per_worker))
        scratch = None
        run_config = self.run_config
        if run_config is None:
            scratch = tempfile.mkdtemp(prefix="layercheck-raytrain-")
            run_config = RunConfig(name=handles.run_id, storage_path=scratch, failure_config=FailureConfig())
        run_config = with_callbacks(run_config, handles.supervisor, cfg.persistence, in_place=cfg.in_place)
        if (run_config.failure_config or FailureConfig()).max_failures == 0:
            logger.warning(
                "FailureConfig(max_failures=0): a lost worker ends the run; LayerCheck recovers only "
                "when Ray Train may restart the worker group (max_failures > 0)"
            )
        trainer_class: type = LayerCheckTorchTrainer
        if cfg.in_place:  # it brings its torch_config (checked in fit(): the user gave none)
            from layercheck.orchestrator.runtime.in_place import InPlaceTorchTrainer

            trainer_class = InPlaceTorchTrainer
        kwargs = {"torch_config": self.torch_config} if self.torch_config is not None else {}
        try:
            trainer = trainer_class(
                loop,
                train_loop_config=self.train_loop_config,
                scaling_config=with_spares(scaling, cfg.spares),
                run_config=run_config,
                **kwargs,
            )
            error = fit_watched(handles, trainer, on_progress=self.on_progress)
        finally:
            if scratch is not None:
                shutil.rmtree(scratch, ignore_errors=True)
        return finish_run(handles, error=error)


def check_in_place(scaling_config: Any, torch_config: TorchConfig | None) -> None:
    """``CheckpointConfig(in_place=True)`` needs a fixed group and LayerCheck's own ``torch_config``
    (Ray Train forms no process group in place: the ranks form theirs through the supervisor)."""
    if not isinstance(scaling_config.num_workers, int):
        raise ConfigError(
            "CheckpointConfig(in_place=True) needs a fixed group: ScalingConfig(num_workers=<int>), "
            f"got {scaling_config.num_workers!r} (Ray Train replaces workers in place only in a fixed group)"
        )
    if torch_config is not None:
        raise ConfigError(
            "CheckpointConfig(in_place=True) brings its own torch_config (each worker a replica group, the "
            "process group formed by LayerCheck): leave LayerCheckTrainer(torch_config=...) unset"
        )


def with_spares(scaling_config: Any, spares: int) -> Any:
    """The ``ScalingConfig`` Ray Train runs: the user's training workers and the warm spares
    (``CheckpointConfig.spares``), each spare a worker of the same resources.

    (``Any``: a ``ray.train.ScalingConfig`` is Ray Train v2's at run time, whose ``num_workers`` is an
    int or an elastic ``(min, max)``, but type checkers resolve that name to the v1 class, whose
    ``num_workers`` may be a Tune search space.)"""
    if not spares:
        return scaling_config
    return dataclasses.replace(scaling_config, num_workers=scaling_config.num_workers + spares)


def spares_figures(status: dict[str, Any] | None, scaling_config: Any) -> dict[str, Any] | None:
    """What the warm spares cost and did, as the run summary says it for the built-in loop: idle
    workers held beside the training ones (``status``: the supervisor's view of the roster)."""
    if not status:
        return None
    return {
        **status,
        "training_workers": scaling_config.num_workers,
        "cpus_per_worker": float(scaling_config.num_cpus_per_worker or 1),
        "gpus_per_worker": 1 if scaling_config.use_gpu else 0,
    }


def planned_layer_map(model: PlannedModel, spec: LayerMapSpec | None = None) -> LayerMap:
    """The layer map of ``model`` (see :class:`LayerCheckTrainer`), built without its weights."""
    if isinstance(model, LayerMap):
        return model
    if isinstance(model, torch.nn.Module):
        return model_layer_map(model, spec)
    if hasattr(model, "model_type") and hasattr(model, "to_dict"):  # a transformers config
        import transformers

        with torch.device("meta"):
            return model_layer_map(transformers.AutoModelForCausalLM.from_config(model), spec)
    if callable(model):
        with torch.device("meta"):
            return model_layer_map(model(), spec)
    raise TypeError(
        "model: a transformers config, a function returning the module, the module or a LayerMap; "
        f"got {type(model).__name__}"
    )


def _takes_config(fn: Callable[..., object]) -> bool:
    return len(inspect.signature(fn).parameters) > 0
