"""A user's training engine made known to LayerCheck: its layer map, state layout and drift probe.

The built-in loop builds its engine itself (:mod:`layercheck.workers.engine`); a user's own loop
builds theirs — ``deepspeed.initialize`` with their model, optimizer and config, or a model sharded
with ``fully_shard`` and a torch Adam/AdamW — and :func:`attach_engine` maps whatever came out
through the engine's adapter (:mod:`layercheck.workers.engines`). Nothing here talks to Ray.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from layercheck.policies.layer_map import LayerMap, LayerMapSpec, model_layer_map
from layercheck.workers.drift.diff import probe_for
from layercheck.workers.drift.probe import DriftReader
from layercheck.workers.engines.base import TrainingEngine
from layercheck.workers.layout import StateLayout

if TYPE_CHECKING:
    from torch.optim.lr_scheduler import LRScheduler

    from layercheck.workers.engines.deepspeed import DeepSpeedEngine

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class AttachedEngine:
    """A user's engine and what LayerCheck keeps beside it (the fields ``load_composite`` reads)."""

    adapter: TrainingEngine
    layer_map: LayerMap
    layout: StateLayout
    probe: DriftReader

    @property
    def engine(self) -> Any:
        """The engine's own object: the ``DeepSpeedEngine``, or the ``fully_shard`` model."""
        return self.adapter.native


def adapter_for(
    engine: DeepSpeedEngine | torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    lr_scheduler: LRScheduler | None = None,
) -> TrainingEngine:
    """The adapter for what a user's loop built: a ``DeepSpeedEngine`` alone (or a wrapper holding
    one: Accelerate's, the ``Trainer``'s), or a ``fully_shard`` model with its optimizer (and
    scheduler). Raises a ``TypeError`` (or the FSDP2 adapter's refusal) naming what was passed and
    what works."""
    from layercheck.workers.engines.deepspeed import DeepSpeedAdapter, find_deepspeed_engine

    deepspeed_engine = find_deepspeed_engine(engine)
    if optimizer is None:
        if deepspeed_engine is not None:
            if lr_scheduler is not None:
                raise TypeError(
                    "lr_scheduler= is for FSDP2: a DeepSpeed engine's scheduler is the one given to "
                    "deepspeed.initialize (engine.lr_scheduler)"
                )
            return DeepSpeedAdapter(deepspeed_engine)
        raise TypeError(
            f"expected the DeepSpeedEngine that deepspeed.initialize returned, or a model sharded with "
            f"fully_shard and its optimizer (attach(model, optimizer)), got {type(engine).__name__} alone"
        )
    from layercheck.workers.engines.fsdp2 import FSDP2Adapter

    return FSDP2Adapter(engine, optimizer, lr_scheduler)


def attach_engine(
    engine: DeepSpeedEngine | torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    lr_scheduler: LRScheduler | None = None,
    layer_map: LayerMapSpec | None = None,
    drift_probe: str = "auto",
    drift_every: int = 1,
) -> AttachedEngine:
    """Map ``engine``'s model onto layers (by name, or by ``layer_map``) and its optimizer state
    onto those layers, and choose the drift probe (measuring every ``drift_every``-th step, the
    policy's). ``engine``: a ``DeepSpeedEngine`` alone, or a ``fully_shard`` model with its
    ``optimizer`` (and ``lr_scheduler``). Raises before any training step:
    :class:`~layercheck.policies.layer_map.UnplacedParameterError` for parameters no layer holds,
    :class:`~layercheck.workers.optim_state.UnsupportedOptimizerError` for a non-Adam optimizer,
    :class:`~layercheck.workers.engines.fsdp2.UnsupportedShardingError` for a sharding the FSDP2
    layout cannot map."""
    adapter = adapter_for(engine, optimizer, lr_scheduler)
    layers = model_layer_map(adapter.module, layer_map)
    layout = adapter.build_layout(layers)
    probe = probe_for(layout, drift_probe, every=drift_every)
    logger.info(
        "attached to a %s engine: %d layers, %s probe", adapter.describe(), len(layers.layers), type(probe).__name__
    )
    return AttachedEngine(adapter=adapter, layer_map=layers, layout=layout, probe=probe)
