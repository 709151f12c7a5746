"""Where each layer's optimizer state lives on this rank, for every ZeRO stage.

One map, built once after ``deepspeed.initialize``, answers for each layer: which elements of
which parameters this rank *owns* (snapshot and drift), which it *needs* to be given on restore,
and the fp32 tensors (the ones the client optimizer steps) that hold them. Snapshot, restore and
the drift probe read this map and never look at ZeRO internals themselves.

Ownership: ZeRO 1-3 partition the fp32 state, so a rank owns (and needs) exactly its fragment.
ZeRO-0 replicates it; a rank *owns* the ``rank``-th contiguous ``1/world_size`` slice of each
parameter (so ranks split the writes instead of each writing a copy) but *needs* the whole
parameter on restore.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from policies.layer_map import LayerMap
from workers import ds_internals
from workers.drift_adamw import DriftAdamW
from workers.shard import ParamSlice

logger = logging.getLogger(__name__)


@dataclass(frozen=True, eq=False)
class Piece:
    """A run of one parameter's flattened elements and where it sits in an fp32 master tensor."""

    slice: ParamSlice
    master: torch.Tensor
    start: int


@dataclass(frozen=True, eq=False)
class LayerLayout:
    """One layer on this rank: owned and needed pieces, fp32 masters, and its param groups."""

    name: str
    owned: tuple[Piece, ...]
    needed: tuple[Piece, ...]
    masters: tuple[torch.Tensor, ...]
    groups: tuple[dict[str, Any], ...]

    @property
    def owned_numel(self) -> int:
        return sum(p.slice.length for p in self.owned)


@dataclass(frozen=True, eq=False)
class StateLayout:
    """Every layer's :class:`LayerLayout`, in model order, and the engine it describes."""

    stage: int
    rank: int
    world_size: int
    layers: Mapping[str, LayerLayout]
    layer_map: LayerMap
    engine: Any
    optimizer: DriftAdamW

    def __getitem__(self, layer: str) -> LayerLayout:
        try:
            return self.layers[layer]
        except KeyError:
            raise KeyError(f"no layer {layer!r}; layers are {list(self.layers)}") from None


def state_view(optimizer: DriftAdamW, piece: Piece, key: str) -> torch.Tensor:
    """The 1-D view of ``piece`` in state ``key`` (``fp32`` is the master weight itself)."""
    base = piece.master if key == "fp32" else optimizer.state[piece.master][key]
    return base.detach().view(-1).narrow(0, piece.start, piece.slice.length)


def zero0_owned_range(numel: int, rank: int, world_size: int) -> tuple[int, int]:
    """(offset, length) of the ZeRO-0 slice a rank owns: contiguous, ``ceil(numel/W)`` long."""
    chunk = math.ceil(numel / world_size)
    offset = min(rank * chunk, numel)
    return offset, max(0, min(chunk, numel - offset))


def build_layout(engine: Any, layer_map: LayerMap) -> StateLayout:
    """Map every layer of ``layer_map`` onto ``engine``'s optimizer state on this rank."""
    stage = int(engine.zero_optimization_stage())
    rank, world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
    optimizer = ds_internals.client_optimizer(engine)
    if not isinstance(optimizer, DriftAdamW):
        raise TypeError(f"the engine's client optimizer must be DriftAdamW, got {type(optimizer).__name__}")
    params = dict(engine.module.named_parameters())
    groups_of = _groups_by_layer(optimizer)
    if stage == 0:
        pieces = _zero0_pieces(engine, layer_map, params, rank, world_size)
    elif stage in (1, 2):
        pieces = _zero12_pieces(engine.optimizer, layer_map, params, _group_indices(optimizer))
    else:
        pieces = _zero3_pieces(engine.optimizer, layer_map, params, _group_indices(optimizer))
    layers: dict[str, LayerLayout] = {}
    for layer in layer_map.layers:
        owned, needed, masters = pieces[layer.name]
        layers[layer.name] = LayerLayout(
            name=layer.name, owned=owned, needed=needed, masters=masters, groups=groups_of[layer.name]
        )
        for master in masters:
            optimizer.init_state(master)  # restore into a fresh engine needs moments to write into
    logger.info("state layout: ZeRO-%d, rank %d of %d, %d layers", stage, rank, world_size, len(layers))
    return StateLayout(stage=stage, rank=rank, world_size=world_size, layers=layers, layer_map=layer_map,
                       engine=engine, optimizer=optimizer)


_Pieces = dict[str, tuple[tuple[Piece, ...], tuple[Piece, ...], tuple[torch.Tensor, ...]]]


def _groups_by_layer(optimizer: DriftAdamW) -> dict[str, tuple[dict[str, Any], ...]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for group in optimizer.param_groups:
        out.setdefault(group["layer"], []).append(group)
    return {k: tuple(v) for k, v in out.items()}


def _group_indices(optimizer: DriftAdamW) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for index, group in enumerate(optimizer.param_groups):
        out.setdefault(group["layer"], []).append(index)
    return out


def _unique(tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    seen: dict[int, torch.Tensor] = {}
    for t in tensors:
        seen.setdefault(id(t), t)
    return tuple(seen.values())


def _zero0_pieces(engine: Any, layer_map: LayerMap, params: Mapping[str, torch.nn.Parameter],
                  rank: int, world_size: int) -> _Pieces:
    master_of = {id(lp): hp for lp, hp in ds_internals.zero0_master_pairs(engine)}
    out: _Pieces = {}
    for layer in layer_map.layers:
        owned, needed = [], []
        for info in layer.params:
            master = master_of[id(params[info.name])]
            offset, length = zero0_owned_range(info.numel, rank, world_size)
            if length:
                owned.append(Piece(ParamSlice(info.name, info.shape, offset, length), master, offset))
            needed.append(Piece(ParamSlice(info.name, info.shape, 0, info.numel), master, 0))
        masters = _unique([p.master for p in needed])
        out[layer.name] = (tuple(owned), tuple(needed), masters)
    return out


def _zero12_pieces(zero_optimizer: Any, layer_map: LayerMap, params: Mapping[str, torch.nn.Parameter],
                   group_indices: Mapping[str, list[int]]) -> _Pieces:
    flats = ds_internals.zero12_flat_partitions(zero_optimizer)  # one per param group, same order
    out: _Pieces = {}
    for layer in layer_map.layers:
        owned: list[Piece] = []
        for info in layer.params:
            fragment = ds_internals.zero12_fragment(params[info.name])
            if fragment is not None:
                owned.append(Piece(ParamSlice(info.name, info.shape, fragment.param_offset, fragment.length),
                                   flats[fragment.flat_index], fragment.flat_start))
        masters = _unique([flats[i] for i in group_indices[layer.name]])
        out[layer.name] = (tuple(owned), tuple(owned), masters)
    return out


def _zero3_pieces(zero_optimizer: Any, layer_map: LayerMap, params: Mapping[str, torch.nn.Parameter],
                  group_indices: Mapping[str, list[int]]) -> _Pieces:
    flats = ds_internals.zero3_flat_partitions(zero_optimizer)  # one per sub-group
    group_of_sub = ds_internals.zero3_sub_group_to_group(zero_optimizer)
    out: _Pieces = {}
    for layer in layer_map.layers:
        owned: list[Piece] = []
        for info in layer.params:
            fragment = ds_internals.zero3_fragment(zero_optimizer, params[info.name])
            if fragment.length:
                owned.append(Piece(ParamSlice(info.name, info.shape, fragment.param_offset, fragment.length),
                                   flats[fragment.flat_index], fragment.flat_start))
        mine = set(group_indices[layer.name])
        masters = _unique([flats[s] for s, g in sorted(group_of_sub.items()) if g in mine])
        out[layer.name] = (tuple(owned), tuple(owned), masters)
    return out


def refresh_forward_weights(layout: StateLayout, layers: Sequence[str]) -> None:
    """Make the forward read the fp32 masters just written for ``layers``.

    Collective at ZeRO 1-3 (every rank must call it, with any ``layers``); ZeRO-0 copies only
    the restored layers' parameters.
    """
    if layout.stage == 0:
        wanted = {id(p.master) for name in layers for p in layout[name].needed}
        pairs = [(lp, hp) for lp, hp in ds_internals.zero0_master_pairs(layout.engine) if id(hp) in wanted]
        ds_internals.zero0_refresh_lp(pairs)
    elif layout.stage in (1, 2):
        ds_internals.zero12_refresh_lp(layout.engine.optimizer)
    else:
        ds_internals.zero3_refresh_lp(layout.engine.optimizer)
