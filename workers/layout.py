"""Where each layer's optimizer state lives on this rank, for every ZeRO stage.

One map, built once after ``deepspeed.initialize``, answers for each layer: which elements of
which parameters this rank *owns* (snapshot and drift), which it *needs* to be given on restore,
and the fp32 tensors (the ones the client optimizer steps) that hold them. Snapshot, restore and
the drift probe read this map and never look at ZeRO internals themselves.

Ownership: ZeRO 1-3 partition the fp32 state, so a rank owns (and needs) exactly its fragment.
ZeRO-0 replicates it; a rank *owns* the ``rank``-th contiguous ``1/world_size`` slice of each
parameter (so ranks split the writes instead of each writing a copy) but *needs* the whole
parameter on restore.

Param groups need not follow layers: a layer's masters and groups are the fp32 tensors and
client param groups that hold any of its parameters (one group for all, decay/no-decay
groups, or LayerCheck's own layer-aligned groups), so several layers may share one master.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from layercheck.policies.layer_map import LayerMap
from layercheck.workers import ds_internals, optim_state
from layercheck.workers.shard import ParamSlice

logger = logging.getLogger(__name__)


@dataclass(frozen=True, eq=False)
class Piece:
    """A run of one parameter's flattened elements and where it sits in an fp32 master tensor."""

    slice: ParamSlice
    master: torch.Tensor
    start: int


@dataclass(frozen=True, eq=False)
class LayerLayout:
    """One layer on this rank: owned and needed pieces, fp32 masters, and the param groups
    holding its parameters (``group_params[i]``: the layer's parameters in ``groups[i]``)."""

    name: str
    owned: tuple[Piece, ...]
    needed: tuple[Piece, ...]
    masters: tuple[torch.Tensor, ...]
    groups: tuple[dict[str, Any], ...]
    """The groups as built; read them through :meth:`StateLayout.groups_of`, which follows an
    optimizer whose ``load_state_dict`` replaced its group dicts (DeepSpeed's ``load_checkpoint``)."""
    group_params: tuple[tuple[str, ...], ...] = ()
    group_indices: tuple[int, ...] = ()
    """Each group's position in the client optimizer's ``param_groups``."""

    @property
    def owned_numel(self) -> int:
        return sum(p.slice.length for p in self.owned)


@dataclass(frozen=True, eq=False)
class StateLayout:
    """Every layer's :class:`LayerLayout`, in model order, and the engine it describes."""

    stage: int
    """The ZeRO stage; 3 for FSDP2, partitioned alike (a rank owns and needs exactly its shard)."""
    rank: int
    world_size: int
    layers: Mapping[str, LayerLayout]
    layer_map: LayerMap
    engine: Any
    optimizer: Any
    """The client optimizer (the one DeepSpeed steps): an Adam-family one, see :mod:`layercheck.workers.optim_state`."""
    refresh: Callable[[Sequence[str]], None] | None = None
    """How the forward comes to read masters a restore wrote, given the layers restored (another
    engine's way, :mod:`layercheck.workers.engines`); ``None``: DeepSpeed's, by ZeRO stage."""

    def groups_of(self, layer: str) -> tuple[dict[str, Any], ...]:
        """The client optimizer's current param groups holding ``layer``."""
        return tuple(self.optimizer.param_groups[i] for i in self[layer].group_indices)

    def __getitem__(self, layer: str) -> LayerLayout:
        try:
            return self.layers[layer]
        except KeyError:
            raise KeyError(f"no layer {layer!r}; layers are {list(self.layers)}") from None


def state_view(optimizer: Any, piece: Piece, key: str) -> torch.Tensor:
    """The 1-D view of ``piece`` in state ``key`` (``fp32`` is the master weight itself)."""
    return _state_of(optimizer, piece.master, key).narrow(0, piece.start, piece.slice.length)


def state_runs(optimizer: Any, pieces: Sequence[Piece], key: str) -> list[torch.Tensor]:
    """1-D views of ``pieces`` in state ``key`` whose concatenation is theirs, in order, with the
    pieces that follow each other in one master joined into one view: copying a layer then takes
    a copy per run, not one per parameter (ZeRO-1/3 lay a param group's partitions end to end)."""
    runs: list[torch.Tensor] = []
    i = 0
    while i < len(pieces):
        first = pieces[i]
        end = first.start + first.slice.length
        i += 1
        while i < len(pieces) and pieces[i].master is first.master and pieces[i].start == end:
            end += pieces[i].slice.length
            i += 1
        runs.append(_state_of(optimizer, first.master, key).narrow(0, first.start, end - first.start))
    return runs


def _state_of(optimizer: Any, master: torch.Tensor, key: str) -> torch.Tensor:
    base = master if key == "fp32" else optimizer.state[master][key]
    return local_part(base).detach().view(-1)


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    """The elements of ``tensor`` this rank holds: a DTensor's local shard (FSDP2: its master is
    the DTensor parameter, which keys the optimizer's state), any other tensor itself."""
    to_local = getattr(tensor, "to_local", None)  # duck-typed: importing DTensor here costs 0.5 s
    if to_local is None:
        return tensor
    with torch.no_grad():  # the local tensor itself, not an autograd view of it
        return to_local()


def zero0_owned_range(numel: int, rank: int, world_size: int) -> tuple[int, int]:
    """(offset, length) of the ZeRO-0 slice a rank owns: contiguous, ``ceil(numel/W)`` long."""
    chunk = math.ceil(numel / world_size)
    offset = min(rank * chunk, numel)
    return offset, max(0, min(chunk, numel - offset))


def build_layout(engine: Any, layer_map: LayerMap) -> StateLayout:
    """Map every layer of ``layer_map`` onto ``engine``'s optimizer state on this rank.

    Raises :class:`~layercheck.workers.optim_state.UnsupportedOptimizerError` for an optimizer whose state
    is not Adam's, and ``KeyError`` for a layer-map parameter the engine's model does not have.
    """
    stage = int(engine.zero_optimization_stage())
    rank, world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
    optimizer = ds_internals.client_optimizer(engine)
    optim_state.check_supported(optimizer)
    params = dict(engine.module.named_parameters())
    missing = [p.name for layer in layer_map.layers for p in layer.params if p.name not in params]
    if missing:
        raise KeyError(f"the layer map names parameters the model does not have: {missing[:8]}")
    group_of = _group_of_param(engine, stage, params)
    if stage == 0:
        pieces = _zero0_pieces(engine, layer_map, params, rank, world_size)
    elif stage in (1, 2):
        pieces = _zero12_pieces(engine.optimizer, layer_map, params, group_of)
    else:
        pieces = _zero3_pieces(engine.optimizer, layer_map, params, group_of)
    layers: dict[str, LayerLayout] = {}
    for layer in layer_map.layers:
        owned, needed, masters = pieces[layer.name]
        indices = sorted({group_of[p.name] for p in layer.params})
        layers[layer.name] = LayerLayout(
            name=layer.name,
            owned=owned,
            needed=needed,
            masters=masters,
            groups=tuple(optimizer.param_groups[i] for i in indices),
            group_params=tuple(tuple(p.name for p in layer.params if group_of[p.name] == i) for i in indices),
            group_indices=tuple(indices),
        )
        for master in masters:
            optim_state.init_state(optimizer, master)  # restore into a fresh engine needs moments to write into
    logger.info(
        "state layout: ZeRO-%d, rank %d of %d, %d layers over %d param groups (%s)",
        stage,
        rank,
        world_size,
        len(layers),
        len(optimizer.param_groups),
        type(optimizer).__name__,
    )
    return StateLayout(
        stage=stage,
        rank=rank,
        world_size=world_size,
        layers=layers,
        layer_map=layer_map,
        engine=engine,
        optimizer=optimizer,
    )


_Pieces = dict[str, tuple[tuple[Piece, ...], tuple[Piece, ...], tuple[torch.Tensor, ...]]]


def _group_of_param(engine: Any, stage: int, params: Mapping[str, torch.nn.Parameter]) -> dict[str, int]:
    """Per model parameter name, the index of the client param group that holds it."""
    if stage == 0:
        master_of = {id(lp): hp for lp, hp in ds_internals.zero0_master_pairs(engine)}
        index_of = {
            id(p): i for i, g in enumerate(ds_internals.client_optimizer(engine).param_groups) for p in g["params"]
        }
        return {name: index_of[id(master_of[id(p)])] for name, p in params.items() if id(p) in master_of}
    groups = (
        ds_internals.zero12_param_groups(engine.optimizer)
        if stage in (1, 2)
        else ds_internals.zero3_param_groups(engine.optimizer)
    )
    index_of = {id(p): i for i, group in enumerate(groups) for p in group}
    return {name: index_of[id(p)] for name, p in params.items() if id(p) in index_of}


def _unique(tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    seen: dict[int, torch.Tensor] = {}
    for t in tensors:
        seen.setdefault(id(t), t)
    return tuple(seen.values())


def _zero0_pieces(
    engine: Any, layer_map: LayerMap, params: Mapping[str, torch.nn.Parameter], rank: int, world_size: int
) -> _Pieces:
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


def _zero12_pieces(
    zero_optimizer: Any, layer_map: LayerMap, params: Mapping[str, torch.nn.Parameter], group_of: Mapping[str, int]
) -> _Pieces:
    flats = ds_internals.zero12_flat_partitions(zero_optimizer)  # one per param group, same order
    out: _Pieces = {}
    for layer in layer_map.layers:
        owned: list[Piece] = []
        for info in layer.params:
            fragment = ds_internals.zero12_fragment(params[info.name])
            if fragment is not None:
                owned.append(
                    Piece(
                        ParamSlice(info.name, info.shape, fragment.param_offset, fragment.length),
                        flats[fragment.flat_index],
                        fragment.flat_start,
                    )
                )
        masters = _unique([flats[i] for i in sorted({group_of[p.name] for p in layer.params})])
        out[layer.name] = (tuple(owned), tuple(owned), masters)
    return out


def _zero3_pieces(
    zero_optimizer: Any, layer_map: LayerMap, params: Mapping[str, torch.nn.Parameter], group_of: Mapping[str, int]
) -> _Pieces:
    flats = ds_internals.zero3_flat_partitions(zero_optimizer)  # one per sub-group
    group_of_sub = ds_internals.zero3_sub_group_to_group(zero_optimizer)
    out: _Pieces = {}
    for layer in layer_map.layers:
        owned: list[Piece] = []
        for info in layer.params:
            fragment = ds_internals.zero3_fragment(zero_optimizer, params[info.name])
            if fragment.length:
                owned.append(
                    Piece(
                        ParamSlice(info.name, info.shape, fragment.param_offset, fragment.length),
                        flats[fragment.flat_index],
                        fragment.flat_start,
                    )
                )
        mine = {group_of[p.name] for p in layer.params}
        masters = _unique([flats[s] for s, g in sorted(group_of_sub.items()) if g in mine])
        out[layer.name] = (tuple(owned), tuple(owned), masters)
    return out


def refresh_forward_weights(layout: StateLayout, layers: Sequence[str]) -> None:
    """Make the forward read the fp32 masters just written for ``layers``.

    Collective at ZeRO 1-3 (every rank must call it, with any ``layers``); ZeRO-0 copies only
    the restored layers' parameters; another engine's layout brings its own ``refresh``.
    """
    if layout.refresh is not None:
        layout.refresh(layers)
    elif layout.stage == 0:
        wanted = {id(p.master) for name in layers for p in layout[name].needed}
        pairs = [(lp, hp) for lp, hp in ds_internals.zero0_master_pairs(layout.engine) if id(hp) in wanted]
        ds_internals.zero0_refresh_lp(pairs)
    elif layout.stage in (1, 2):
        ds_internals.zero12_refresh_lp(layout.engine.optimizer)
    else:
        ds_internals.zero3_refresh_lp(layout.engine.optimizer)
