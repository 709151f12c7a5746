"""A :class:`~layercheck.workers.shard.LayerShard` as it travels between Ray processes: metadata plus
numpy arrays, which Ray's object store carries without pickling the tensors."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # imported by the writers (WriterActor), not by the supervisor that starts them
    import torch

from layercheck.workers.shard import STATE_KEYS, LayerShard, ParamSlice


@dataclass(frozen=True)
class WireShard:
    layer: str
    step: int
    rank: int
    world_size: int
    slices: tuple[tuple[str, tuple[int, ...], int, int], ...]
    arrays: dict[str, np.ndarray]
    optimizer_step: int
    groups: tuple[dict[str, Any], ...]
    base: bool
    origin: str = "policy"
    """``policy`` (a scheduled snapshot) or ``capture`` (a survivor's hand-over at a failure)."""

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays.values())


def to_wire(shard: LayerShard, *, base: bool, origin: str = "policy") -> WireShard:
    """Views of the shard's host tensors: serialise (``.remote()`` does) before reusing them."""
    return WireShard(
        layer=shard.layer,
        step=shard.step,
        rank=shard.rank,
        world_size=shard.world_size,
        slices=tuple((s.name, tuple(s.shape), s.offset, s.length) for s in shard.slices),
        arrays={key: shard.tensors[key].detach().cpu().numpy() for key in STATE_KEYS},
        optimizer_step=shard.optimizer_step,
        groups=tuple(shard.groups),
        base=base,
        origin=origin,
    )


def from_wire(wire: WireShard) -> LayerShard:
    return LayerShard(
        layer=wire.layer,
        step=wire.step,
        rank=wire.rank,
        world_size=wire.world_size,
        slices=tuple(
            ParamSlice(name=n, shape=tuple(shape), offset=o, length=length) for n, shape, o, length in wire.slices
        ),
        tensors={key: _tensor(a) for key, a in wire.arrays.items()},
        optimizer_step=wire.optimizer_step,
        groups=wire.groups,
    )


def _tensor(array: np.ndarray) -> torch.Tensor:
    """Zero-copy; the object store hands out read-only buffers, which writing out only reads."""
    import torch  # see the module's imports

    if array.size == 0:
        return torch.empty(0, dtype=torch.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "array is not writable"
        return torch.from_numpy(array)
