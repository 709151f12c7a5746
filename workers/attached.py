"""A DeepSpeed engine the user built, made known to LayerCheck: its layer map, state layout and
drift probe, and the few things LayerCheck does to it (restore to a step, read its learning rate).

The built-in loop builds its engine itself (:mod:`layercheck.workers.engine`); a user's own loop calls
``deepspeed.initialize`` with their own model, optimizer, param groups and DeepSpeed config, and
:func:`attach_engine` maps whatever came out. Nothing here talks to Ray.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass
from typing import Any

from layercheck.policies.layer_map import LayerMap, LayerMapSpec, model_layer_map
from layercheck.workers import ds_internals
from layercheck.workers.drift.diff import probe_for
from layercheck.workers.drift.probe import DriftReader
from layercheck.workers.layout import StateLayout, build_layout

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class AttachedEngine:
    """A user's engine and what LayerCheck keeps beside it (the fields ``load_composite`` reads)."""

    engine: Any
    layer_map: LayerMap
    layout: StateLayout
    probe: DriftReader


def unwrap_engine(engine: Any) -> Any:
    """The ``DeepSpeedEngine`` behind ``engine`` (Accelerate and HF wrappers keep it as ``.engine``
    or ``.model_wrapped``); raise a ``TypeError`` naming what was passed otherwise."""
    for candidate in (engine, getattr(engine, "model_wrapped", None), getattr(engine, "engine", None)):
        if candidate is not None and hasattr(candidate, "zero_optimization_stage") and hasattr(candidate, "module"):
            return candidate
    raise TypeError(f"expected the DeepSpeedEngine that deepspeed.initialize returned, got {type(engine).__name__}")


def attach_engine(
    engine: Any, *, layer_map: LayerMapSpec | None = None, drift_probe: str = "auto", drift_every: int = 1
) -> AttachedEngine:
    """Map ``engine``'s model onto layers (by name, or by ``layer_map``) and its optimizer state
    onto those layers, and choose the drift probe (measuring every ``drift_every``-th step, the
    policy's). Raises before any training step:
    :class:`~layercheck.policies.layer_map.UnplacedParameterError` for parameters no layer holds,
    :class:`~layercheck.workers.optim_state.UnsupportedOptimizerError` for a non-Adam optimizer."""
    engine = unwrap_engine(engine)
    if ds_internals.client_optimizer(engine) is None:
        raise ValueError(
            "the engine has no optimizer: pass one to deepspeed.initialize or name one in the "
            'DeepSpeed config ("optimizer": {"type": "AdamW", ...})'
        )
    layers = model_layer_map(engine.module, layer_map)
    layout = build_layout(engine, layers)
    probe = probe_for(layout, drift_probe, every=drift_every)
    logger.info(
        "attached to a ZeRO-%d engine: %d layers, %s probe", layout.stage, len(layers.layers), type(probe).__name__
    )
    return AttachedEngine(engine=engine, layer_map=layers, layout=layout, probe=probe)


def current_lr(engine: Any) -> float:
    """The learning rate the next optimizer step will use (the first param group's)."""
    return float(ds_internals.client_optimizer(engine).param_groups[0]["lr"])


def seek_engine(engine: Any, step: int) -> None:
    """Make a user's engine continue as if ``step`` optimizer steps had been taken: DeepSpeed's
    counters and ``engine.lr_scheduler`` (DeepSpeed's own schedulers jump there; a torch
    scheduler is stepped ``step`` times, which is what training would have done). Weights and
    moments are not touched; a scheduler the user steps outside the engine is theirs to move."""
    engine.global_steps = step
    engine.global_samples = step * engine.train_batch_size()
    engine.micro_steps = step * engine.gradient_accumulation_steps()
    scheduler = getattr(engine, "lr_scheduler", None)
    if scheduler is None or step == 0:
        return
    if hasattr(scheduler, "last_batch_iteration"):  # deepspeed.runtime.lr_schedules
        scheduler.step(step - 1)
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "lr_scheduler.step() before optimizer.step()"
            for _ in range(step):
                scheduler.step()
    logger.info("engine moved to step %d (lr %.3g)", step, current_lr(engine))
