"""Build a DeepSpeed engine for a Hugging Face causal LM with layer-aligned param groups.

Each layer of the layer map becomes one or two optimizer param groups, ``<layer>/decay``
(matrices, ``weight_decay`` as configured) and ``<layer>/no_decay`` (vectors, 0), so every
group belongs to exactly one layer. That alignment is what lets the drift probe read a layer's
drift off the optimizer, and lets one layer's state be snapshotted or restored on its own.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from layercheck.policies.layer_map import LayerMap, build_layer_map, layer_map_of
from layercheck.workers import ds_internals, env
from layercheck.workers.config import EngineConfig, ModelConfig, OptimConfig
from layercheck.workers.drift.adamw import DriftAdamW
from layercheck.workers.drift.probe import DriftProbe, DriftReader
from layercheck.workers.freeze import apply_freeze, lr_scale
from layercheck.workers.layout import StateLayout, build_layout
from layercheck.workers.lr_schedule import make_scheduler, seek_scheduler

if TYPE_CHECKING:
    from transformers import PreTrainedModel

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class TrainEngine:
    """A built engine and what LayerCheck keeps beside it."""

    engine: Any
    """The ``deepspeed.DeepSpeedEngine``: call it for the forward, ``backward``, ``step``."""
    layer_map: LayerMap
    optimizer: DriftAdamW
    layout: StateLayout
    probe: DriftReader
    model_cfg: ModelConfig
    optim_cfg: OptimConfig
    engine_cfg: EngineConfig

    @property
    def step(self) -> int:
        """Optimizer steps taken so far (DeepSpeed's ``global_steps``)."""
        return int(self.engine.global_steps)


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


def deepspeed_config(cfg: EngineConfig) -> dict[str, Any]:
    """The DeepSpeed config dict for ``cfg``; ``cfg.extra_ds_config`` is merged last."""
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": cfg.micro_batch,
        "gradient_accumulation_steps": cfg.grad_accum,
        "gradient_clipping": cfg.grad_clip,
        "zero_optimization": {"stage": cfg.zero_stage},
        "bf16": {"enabled": cfg.precision == "bf16"},
        # DriftAdamW subclasses AdamW; DeepSpeed checks the exact type, so allow it explicitly.
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }
    return _merge(config, cfg.extra_ds_config)


def _merge(base: dict[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        out[key] = _merge(out[key], value) if isinstance(value, Mapping) and isinstance(out.get(key), dict) else value
    return out


def warm_engine_imports() -> None:
    """Import now what :func:`build_engine` would import on its first call: DeepSpeed, and the Muon
    optimizer its ZeRO optimizers import as they are built (see
    :func:`ds_internals.import_muon_compiling_on_first_call`). For a process that waits before it
    builds its engine (a warm spare), so that the wait pays for them rather than the recovery; and
    before a user's own loop (``LayerCheckTrainer``'s wrapper), whose engine build would otherwise
    import Muon with torch's inductor, and JIT-build DeepSpeed's inference-only CPU comm op
    (:func:`ds_internals.skip_inference_comm_op`)."""
    env.set_accelerator()
    import deepspeed  # noqa: F401

    ds_internals.import_muon_compiling_on_first_call()
    ds_internals.skip_inference_comm_op()  # before the user's deepspeed.initialize starts DeepSpeed's backend


def build_engine(
    model_cfg: ModelConfig, optim_cfg: OptimConfig, engine_cfg: EngineConfig, *, model: PreTrainedModel | None = None
) -> TrainEngine:
    """Initialise distributed state if needed and build the engine, layout and drift probe.
    ``model``: ``build_model(model_cfg)``'s result, built beforehand (it needs no process group:
    an in-place rank builds it while it waits for the others); built here if ``None``."""
    env.init_distributed()
    import deepspeed  # late: env.init_distributed sets the accelerator first

    ds_internals.check_deepspeed_version(deepspeed.__version__)
    ds_internals.import_muon_compiling_on_first_call()  # ~2 s of CPU less per engine build
    model = model if model is not None else build_model(model_cfg)
    layer_map = layer_map_of(model)
    optimizer = DriftAdamW(
        param_groups(model, layer_map, optim_cfg),
        lr=optim_cfg.lr,
        betas=optim_cfg.betas,
        eps=optim_cfg.eps,
        weight_decay=optim_cfg.weight_decay,
        drift_step=optim_cfg.drift_step,
    )
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        optimizer=optimizer,
        lr_scheduler=lambda opt: make_scheduler(opt, optim_cfg),
        config=deepspeed_config(engine_cfg),
    )
    _undo_zero0_init_step(engine, optimizer)
    layout = build_layout(engine, layer_map)
    logger.info(
        "engine built: ZeRO-%d %s, %d layers, %d param groups",
        engine_cfg.zero_stage,
        engine_cfg.precision,
        len(layer_map.layers),
        len(optimizer.param_groups),
    )
    return TrainEngine(
        engine=engine,
        layer_map=layer_map,
        optimizer=optimizer,
        layout=layout,
        probe=DriftProbe(layout),
        model_cfg=model_cfg,
        optim_cfg=optim_cfg,
        engine_cfg=engine_cfg,
    )


def _undo_zero0_init_step(engine: Any, optimizer: DriftAdamW) -> None:
    """Undo the zero-gradient ``step()`` DeepSpeed's bf16 ZeRO-0 optimizer runs at init.

    ``FP16_UnfusedOptimizer.initialize_optimizer_states`` steps the client optimizer once to
    create its state: Adam's count becomes 1 and weight decay shrinks the fp32 masters, which
    then no longer match the model. Copy the masters back from the model, drop that state and
    discard the drift it produced, so every stage starts from step 0 with the same weights.
    """
    pairs = (
        [(lp, hp) for lp, hp in ds_internals.zero0_master_pairs(engine) if lp is not hp]
        if engine.zero_optimization_stage() == 0
        else []
    )
    with torch.no_grad():
        for lp, hp in pairs:
            hp.copy_(lp.float())
            optimizer.state.pop(hp, None)
    optimizer.take_drift()
    if pairs:
        logger.info(
            "undid DeepSpeed's init-time optimizer step on %d fp32 masters (ZeRO-0 %s)",
            len(pairs),
            engine.optimizer.__class__.__name__,
        )


def seek_step(train_engine: TrainEngine, step: int) -> None:
    """Make the engine continue as if ``step`` optimizer steps had been taken: DeepSpeed's
    counters and the learning-rate schedule. Weights and moments are not touched."""
    engine = train_engine.engine
    engine.global_steps = step
    engine.global_samples = step * engine.train_batch_size()
    engine.micro_steps = step * engine.gradient_accumulation_steps()
    seek_scheduler(engine.lr_scheduler, step)
    train_engine.probe.reset(step + 1)  # it measures the steps a run that got here would
    logger.info("engine moved to step %d (lr %.3g)", step, engine.lr_scheduler.get_last_lr()[0])


def shutdown(train_engine: TrainEngine) -> None:
    """Release the engine and leave the process group (avoids a ZeRO-3 abort at exit). The
    process can then build another engine in a new group (an in-place recovery's survivor).

    On the way out of a lost group, Ray Train's teardown may have destroyed the process group
    already (from another thread of the worker), and ZeRO-3's release then fails asking for its
    rank: that error is logged, not raised, so it does not replace the error the rank is leaving
    with (the peer's loss)."""
    try:
        train_engine.engine.destroy()
    except Exception as error:
        if torch.distributed.is_initialized():
            raise
        logger.info("the engine's release found its process group gone (a lost group's teardown): %r", error)
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
    from (:func:`ds_internals.reset_for_next_engine`: DeepSpeed's references to the group and its
    clones, ZeRO-3's id counters), also when the destroy raises. Also after a peer's death:
    destroying a gloo group whose peer is gone does not block."""
    try:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    finally:
        ds_internals.reset_for_next_engine()
