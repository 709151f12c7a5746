"""A simulated rank's training state without a model: one flat fp32 parameter per layer of a
model's layer table (scaled), this rank's contiguous share of it, a real ``torch.optim.AdamW`` with
its moments, and a per-step drift report. A :class:`~layercheck.workers.layout.StateLayout` over it
is all :class:`~layercheck.workers.loop.StepProtocol`, the snapshot, the capture and the composite
load need, so the harness runs them as a rank would, ZeRO-3 style (a rank owns and needs its share).

A "step" moves the optimizer's step count and one element of each layer: the protocol's costs do not
depend on what the elements hold, and updating all of them would measure memory bandwidth."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from layercheck.policies.configs import drift_measured
from layercheck.policies.layer_map import Layer, LayerMap, ParamInfo
from layercheck.workers import optim_state
from layercheck.workers.drift.probe import LayerDrift
from layercheck.workers.layout import LayerLayout, Piece, StateLayout, zero0_owned_range
from layercheck.workers.shard import ParamSlice

#: Per-step mean absolute update, as a multiple of the learning rate: what DESIGN.md measured on a
#: fine-tuning run (blocks about 0.2 × lr, the embedding about 0.4 ×).
DRIFT_PER_LR = 0.2


def param_name(layer: str) -> str:
    """The one flat parameter that stands for ``layer``."""
    return f"{layer}.flat"


def synthetic_layer_map(numel: Mapping[str, int]) -> LayerMap:
    return LayerMap(layers=tuple(Layer(n, (ParamInfo(param_name(n), (int(k),), True),)) for n, k in numel.items()))


class SyntheticRank:
    """Rank ``rank`` of ``world_size``: what a built engine is to the protocol (``layout``,
    ``layer_map``; see :func:`layercheck.orchestrator.runtime.train_fn.recover`)."""

    def __init__(self, numel: Mapping[str, int], *, rank: int, world_size: int, drift_every: int = 1) -> None:
        self.rank = rank
        self.drift_every = drift_every
        self.layer_map = synthetic_layer_map(numel)
        self.steps = 0
        masters, layers = [], {}
        for index, (name, count) in enumerate(numel.items()):
            offset, length = zero0_owned_range(int(count), rank, world_size)
            master = torch.nn.Parameter(torch.zeros(length))
            masters.append({"params": [master], "name": name})
            piece = Piece(ParamSlice(param_name(name), (int(count),), offset, length), master, 0)
            layers[name] = LayerLayout(
                name=name,
                owned=(piece,),
                needed=(piece,),
                masters=(master,),
                groups=(masters[-1],),
                group_params=((param_name(name),),),
                group_indices=(index,),
            )
        self.optimizer = torch.optim.AdamW(masters, lr=1e-5)
        for group in self.optimizer.param_groups:
            optim_state.init_state(self.optimizer, group["params"][0])
        self.layout = StateLayout(
            stage=3,
            rank=rank,
            world_size=world_size,
            layers=layers,
            layer_map=self.layer_map,
            optimizer=self.optimizer,
            steps_taken=lambda: self.steps,
            kind="synthetic",
        )

    def step(self, step: int, lr: float) -> LayerDrift:
        """Take "optimizer step" ``step``: every layer's step count, one element; this rank's drift."""
        self.steps = step
        l1, counts = {}, {}
        for name in self.layer_map.names:
            master = self.layout[name].masters[0]
            optim_state.set_step(self.optimizer, master, step)
            if master.numel():
                with torch.no_grad():
                    master[0] += lr
            counts[name] = master.numel()
            l1[name] = DRIFT_PER_LR * lr * master.numel()
        measured = drift_measured(step, self.drift_every)
        return LayerDrift(step=step, l1=l1 if measured else {}, numel=counts if measured else {}, measured=measured)
