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

from layercheck.policies.layer_map import LayerMap, canonical_name
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


def _no_refresh(layers: Sequence[str]) -> None:
    """For a forward that reads the masters themselves (no separate compute copy)."""


def _untrained() -> int:
    return 0


@dataclass(frozen=True, eq=False)
class StateLayout:
    """Every layer's :class:`LayerLayout`, in model order, on this rank: what the snapshot, the
    restore and the drift probe read, whichever engine built it (:mod:`layercheck.workers.engines`)."""

    stage: int
    """How the state is split: 0 replicated (DeepSpeed ZeRO-0: a rank owns a ``1/world_size``
    slice of each parameter but needs it whole), else partitioned (ZeRO 1-3, FSDP2 as 3: a rank
    needs exactly its shard, and owns it; under HSDP its replicas hold the same shard and each
    owns a ``1/replicas`` run of it)."""
    rank: int
    world_size: int
    layers: Mapping[str, LayerLayout]
    layer_map: LayerMap
    optimizer: torch.optim.Optimizer
    """The client optimizer (the one the engine steps): an Adam-family one, see :mod:`layercheck.workers.optim_state`."""
    steps_taken: Callable[[], int] = _untrained
    """The optimizer steps the engine has taken (a snapshot's step, a restore's check of a fresh engine)."""
    refresh: Callable[[Sequence[str]], None] = _no_refresh
    """How the forward comes to read masters a restore wrote, given the layers restored: the
    engine's own way (:func:`refresh_forward_weights`)."""
    kind: str = ""
    """Which engine built it (``deepspeed``, ``fsdp2``): for the logs and the summary only."""
    subgroups: bool = False
    """The engine's collectives run in groups smaller than the world (HSDP's replicate and shard
    groups): a survivor may wait on a live peer rather than on the lost one."""

    def groups_of(self, layer: str) -> tuple[dict[str, Any], ...]:
        """The client optimizer's current param groups holding ``layer``."""
        return tuple(self.optimizer.param_groups[i] for i in self[layer].group_indices)

    def __getitem__(self, layer: str) -> LayerLayout:
        try:
            return self.layers[layer]
        except KeyError:
            raise KeyError(f"no layer {layer!r}; layers are {list(self.layers)}") from None


def parameters_by_name(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """``model``'s parameters by name, each also under its
    :func:`~layercheck.policies.layer_map.canonical_name` (the layer map's)."""
    out: dict[str, torch.nn.Parameter] = {}
    for name, param in model.named_parameters():
        out[name] = param
        out.setdefault(canonical_name(name), param)
    return out


def state_view(optimizer: torch.optim.Optimizer, piece: Piece, key: str) -> torch.Tensor:
    """The 1-D view of ``piece`` in state ``key`` (``fp32`` is the master weight itself)."""
    return _state_of(optimizer, piece.master, key).narrow(0, piece.start, piece.slice.length)


def state_runs(optimizer: torch.optim.Optimizer, pieces: Sequence[Piece], key: str) -> list[torch.Tensor]:
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


def _state_of(optimizer: torch.optim.Optimizer, master: torch.Tensor, key: str) -> torch.Tensor:
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


def refresh_forward_weights(layout: StateLayout, layers: Sequence[str]) -> None:
    """Make the forward read the fp32 masters just written for ``layers`` (the engine's own way,
    :attr:`StateLayout.refresh`). Collective where the engine's is (DeepSpeed ZeRO 1-3: every rank
    calls it, with any ``layers``)."""
    layout.refresh(layers)
