"""Build the built-in loop's engine (DeepSpeed or FSDP2) for a Hugging Face causal LM with
layer-aligned param groups.

Each layer of the layer map becomes one or two optimizer param groups, ``<layer>/decay``
(matrices, ``weight_decay`` as configured) and ``<layer>/no_decay`` (vectors, 0), so every
group belongs to exactly one layer. That alignment is what lets the drift probe read a layer's
drift off the optimizer, and lets one layer's state be snapshotted or restored on its own.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from layercheck.policies.layer_map import LayerMap, build_layer_map, layer_map_of
from layercheck.workers import env
from layercheck.workers.config import EngineConfig, ModelConfig, OptimConfig
from layercheck.workers.drift.adamw import DriftAdamW
from layercheck.workers.drift.probe import DriftProbe, DriftReader
from layercheck.workers.engines.base import TrainingEngine
from layercheck.workers.freeze import apply_freeze, lr_scale
from layercheck.workers.layout import StateLayout
from layercheck.workers.lr_schedule import make_scheduler

if TYPE_CHECKING:
    from transformers import PreTrainedModel

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class TrainEngine:
    """A built engine and what LayerCheck keeps beside it."""

    adapter: TrainingEngine
    """The engine behind LayerCheck's protocol: its :meth:`~TrainingEngine.train_step`, counters, release."""
    layer_map: LayerMap
    optimizer: DriftAdamW
    layout: StateLayout
    probe: DriftReader
    model_cfg: ModelConfig
    optim_cfg: OptimConfig
    engine_cfg: EngineConfig

    @property
    def engine(self) -> Any:
        """The engine's own object: the ``DeepSpeedEngine``, or the ``fully_shard`` model."""
        return self.adapter.native

    @property
    def step(self) -> int:
        """Optimizer steps taken so far."""
        return self.adapter.steps_taken()


def build_model(cfg: ModelConfig) -> PreTrainedModel:
    """The model in fp32 on the host; DeepSpeed casts and moves it."""
    import transformers

    torch.manual_seed(cfg.seed)
    if cfg.path is not None:
        model = transformers.AutoModelForCausalLM.from_pretrained(cfg.path, dtype=torch.float32, local_files_only=True)
    else:
        hf = dict(cfg.hf_config or {})
        model_type = hf.pop("model_type")
        config = transformers.AutoConfig.for_model(model_type, **hf)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    apply_freeze(model, cfg.freeze)
    return model


def layer_map_for(model: ModelConfig) -> LayerMap:
    """The model's layer map without allocating its weights (built on the meta device)."""
    import transformers

    if model.path is not None:
        config = transformers.AutoConfig.from_pretrained(model.path, local_files_only=True)
    else:
        hf = dict(model.hf_config or {})
        config = transformers.AutoConfig.for_model(hf.pop("model_type"), **hf)
    with torch.device("meta"):
        meta = transformers.AutoModelForCausalLM.from_config(config)
    apply_freeze(meta, model.freeze)
    return layer_map_of(meta)


def param_groups(model: torch.nn.Module, layer_map: LayerMap, cfg: OptimConfig) -> list[dict[str, Any]]:
    """One group per (layer, decay kind) present, in model order, named ``<layer>/decay|no_decay``;
    each at the layer's peak lr under ``cfg.layer_lr_decay`` (``lr_scale`` records the factor)."""
    params = dict(model.named_parameters())
    num_blocks = _num_blocks(model) if cfg.layer_lr_decay != 1.0 else 0
    groups: list[dict[str, Any]] = []
    for layer in layer_map.layers:
        scale = lr_scale(layer.name, num_blocks, cfg.layer_lr_decay)
        for kind, infos, decay in (
            ("decay", layer.decay_params, cfg.weight_decay),
            ("no_decay", layer.no_decay_params, 0.0),
        ):
            if infos:
                groups.append(
                    {
                        "params": [params[p.name] for p in infos],
                        "name": f"{layer.name}/{kind}",
                        "layer": layer.name,
                        "lr": cfg.lr * scale,
                        "lr_scale": scale,
                        "betas": tuple(cfg.betas),
                        "eps": cfg.eps,
                        "weight_decay": decay,
                    }
                )
    return groups


def _num_blocks(model: torch.nn.Module) -> int:
    """B: the model's blocks, frozen ones included (the decay counts from the last block)."""
    full = build_layer_map((name, tuple(p.shape)) for name, p in model.named_parameters())
    return sum(1 for name in full.names if name.startswith("block."))


def warm_engine_imports() -> None:
    """Import now what building an engine would import on its first call (DeepSpeed's, see
    :func:`layercheck.workers.engines.deepspeed.warm_imports`): for a process that waits before it
    builds its engine (a warm spare), so that the wait pays for them rather than the recovery; and
    before a user's own loop (``LayerCheckTrainer``'s wrapper), whose engine is not known yet."""
    from layercheck.workers.engines.deepspeed import warm_imports

    warm_imports()


def build_engine(
    model_cfg: ModelConfig, optim_cfg: OptimConfig, engine_cfg: EngineConfig, *, model: PreTrainedModel | None = None
) -> TrainEngine:
    """Initialise distributed state if needed and build the engine (``engine_cfg.backend``), its
    layout and drift probe. ``model``: ``build_model(model_cfg)``'s result, built beforehand (it
    needs no process group: an in-place rank builds it while it waits for the others); built here
    if ``None``."""
    env.init_distributed(engine=engine_cfg.backend)
    model = model if model is not None else build_model(model_cfg)
    layer_map = layer_map_of(model)

    def make_optimizer(sharded: torch.nn.Module) -> DriftAdamW:  # over the parameters as the engine holds them
        return DriftAdamW(
            param_groups(sharded, layer_map, optim_cfg),
            lr=optim_cfg.lr,
            betas=optim_cfg.betas,
            eps=optim_cfg.eps,
            weight_decay=optim_cfg.weight_decay,
            drift_step=optim_cfg.drift_step,
        )

    adapter: TrainingEngine
    if engine_cfg.backend == "fsdp2":
        from layercheck.workers.engines.fsdp2 import build_fsdp2

        adapter = build_fsdp2(model, make_optimizer, lambda opt: make_scheduler(opt, optim_cfg), engine_cfg)
    else:
        from layercheck.workers.engines.deepspeed import build_deepspeed

        adapter = build_deepspeed(model, make_optimizer, lambda opt: make_scheduler(opt, optim_cfg), engine_cfg)
    optimizer = adapter.optimizer
    assert isinstance(optimizer, DriftAdamW)
    optimizer.take_drift()  # anything an engine's init stepped is no training step's drift
    layout = adapter.build_layout(layer_map)
    logger.info(
        "engine built: %s %s, %d layers, %d param groups",
        adapter.describe(),
        engine_cfg.precision,
        len(layer_map.layers),
        len(optimizer.param_groups),
    )
    return TrainEngine(
        adapter=adapter,
        layer_map=layer_map,
        optimizer=optimizer,
        layout=layout,
        probe=DriftProbe(layout),
        model_cfg=model_cfg,
        optim_cfg=optim_cfg,
        engine_cfg=engine_cfg,
    )


def seek_step(train_engine: TrainEngine, step: int) -> None:
    """Make the engine continue as if ``step`` optimizer steps had been taken: its counters and
    the learning-rate schedule. Weights and moments are not touched."""
    train_engine.adapter.seek(step)
    train_engine.probe.reset(step + 1)  # it measures the steps a run that got here would


def shutdown(train_engine: TrainEngine) -> None:
    """Release the engine and leave the process group (avoids a ZeRO-3 abort at exit). The
    process can then build another engine in a new group (an in-place recovery's survivor)."""
    try:
        train_engine.adapter.release()
    finally:
        leave_group()


def forget_trainer_state() -> None:
    """Release what transformers and accelerate keep per process of a user's ``Trainer``, before the
    user's loop runs again in the same process (an in-place recovery of a ``LayerCheckTrainer``
    loop): transformers' ZeRO-3 switch (the ``HfDeepSpeedConfig`` weak reference; while it lives, a
    model built from a config is built under ``zero.Init``, broadcasting its parameters, while the
    fresh replacement builds its model before its ``Trainer`` exists, without: found as a hang of
    the two in different collectives), and accelerate's process state, bound to the old group.
    Neither is imported here if the loop never did."""
    hf_deepspeed = sys.modules.get("transformers.integrations.deepspeed")
    if hf_deepspeed is not None:
        hf_deepspeed.unset_hf_deepspeed_config()
    accelerate_state = sys.modules.get("accelerate.state")
    if accelerate_state is not None:
        accelerate_state.AcceleratorState._reset_state(reset_partial_state=True)


def leave_group() -> None:
    """Destroy the default process group, and reset what a next engine in this process must start
    from (DeepSpeed's references to the group, if it ran here:
    :func:`layercheck.workers.engines.deepspeed.reset_for_next_engine`), also when the destroy
    raises. Also after a peer's death: destroying a gloo group whose peer is gone does not block."""
    try:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    finally:
        deepspeed_adapter = sys.modules.get("layercheck.workers.engines.deepspeed")
        if deepspeed_adapter is not None:
            deepspeed_adapter.reset_for_next_engine()
