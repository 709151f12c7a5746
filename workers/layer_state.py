"""Snapshot chosen layers' state into host memory, and put such state back into a live engine.

A snapshot is this rank's :class:`~layercheck.workers.shard.LayerShard` of each chosen layer: the owned
elements (see :mod:`layercheck.workers.layout`) of the fp32 master weights and both Adam moments, copied
once from the optimizer's own tensors into reused host buffers, plus the Adam step count and
the layer's group hyper-parameters.

Restore is written against a *range reader*, ``read(param_name, key, offset, length)``, that can
produce any element range of a parameter's flattened state: so state saved at one world size or
ZeRO stage loads at another. :func:`needed_slices` says which ranges this rank will ask for;
:class:`ShardReader` serves them from in-memory shards. After writing the masters, the
low-precision weights the forward reads are refreshed, so the next forward sees the restored state.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from layercheck.workers import optim_state
from layercheck.workers.host_buffers import HostBufferPool
from layercheck.workers.layout import (
    LayerLayout,
    Piece,
    StateLayout,
    refresh_forward_weights,
    state_runs,
    state_view,
)
from layercheck.workers.shard import STATE_KEYS, LayerShard, ParamSlice

logger = logging.getLogger(__name__)

#: ``read(param_name, key, offset, length)`` → 1-D float32 tensor of ``length`` elements of
#: state ``key`` (one of :data:`~layercheck.workers.shard.STATE_KEYS`), starting at ``offset`` of the flattened parameter.
RangeReader = Callable[[str, str, int, int], torch.Tensor]

#: Group hyper-parameters a restore puts back. ``lr`` is not among them: it belongs to the
#: schedule, which continues at the recovery step (see ``layercheck.workers.engine.seek_step``).
RESTORED_HYPERPARAMETERS: tuple[str, ...] = ("betas", "eps", "weight_decay")


@dataclass(frozen=True)
class LayerMeta:
    """The per-layer (not per-element) part of a layer state."""

    optimizer_step: int
    groups: tuple[Mapping[str, Any], ...] = ()


class LayerMetaView(Protocol):
    """What a restore reads of a layer's metadata: a :class:`LayerMeta`, or a stored version's
    ``VersionMeta`` (:mod:`layercheck.orchestrator.store.composite_reader`)."""

    @property
    def optimizer_step(self) -> int: ...

    @property
    def groups(self) -> Sequence[Mapping[str, Any]]: ...


def needed_slices(layout: StateLayout, layer: str) -> tuple[ParamSlice, ...]:
    """The parameter ranges a restore of ``layer`` on this rank reads (whole parameters at ZeRO-0)."""
    return tuple(p.slice for p in layout[layer].needed)


def optimizer_step_of(layout: StateLayout, layer: str) -> int:
    """The Adam step count of ``layer`` on this rank (0 before any step)."""
    for master in layout[layer].masters:
        return optim_state.get_step(layout.optimizer, master)
    return 0


def group_metadata(layout: StateLayout, layer: str) -> tuple[dict[str, Any], ...]:
    """The hyper-parameters of the param groups holding ``layer``, JSON-safe, each with the
    names of the layer's parameters in it and the group's position (``index``)."""
    entry = layout[layer]
    out = []
    for group, names, index in zip(layout.groups_of(layer), entry.group_params, entry.group_indices):
        meta = {k: safe for k, v in group.items() if k != "params" and (safe := _json_safe(v)) is not None}
        meta["param_names"] = list(names)
        meta.setdefault("index", index)
        out.append(meta)
    return tuple(out)


def _json_safe(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (tuple, list)) and all(isinstance(v, (bool, int, float, str)) for v in value):
        return list(value)
    return None


def snapshot_layers(
    layout: StateLayout,
    layers: Sequence[str],
    pool: HostBufferPool,
    step: int | None = None,
    *,
    join: bool = True,
    pieces: Mapping[str, Sequence[Piece]] | None = None,
) -> list[LayerShard]:
    """This rank's shard of each of ``layers``, copied into buffers from ``pool``: its owned
    pieces, or ``pieces[layer]`` where given (a survivor's capture, :mod:`layercheck.workers.capture`).

    One copy per owned piece and state key, straight from the optimizer's tensors into the
    host buffer; where those live on a GPU the copies are asynchronous into pinned memory and
    joined once at the end (``join=False``: not joined; the caller orders them by an event, see
    :mod:`layercheck.workers.snapshot_copy`). Release the shards to ``pool`` when they are written.
    """
    step = layout.steps_taken() if step is None else step
    shards = []
    on_device = False
    for name in layers:
        taken = tuple(pieces[name]) if pieces is not None else layout[name].owned
        tensors = {key: _copy_out(layout, taken, key, pool) for key in STATE_KEYS}
        on_device = on_device or any(p.master.is_cuda for p in taken)
        shards.append(
            LayerShard(
                layer=name,
                step=step,
                rank=layout.rank,
                world_size=layout.world_size,
                slices=tuple(p.slice for p in taken),
                tensors=tensors,
                optimizer_step=optimizer_step_of(layout, name),
                groups=group_metadata(layout, name),
            )
        )
    if on_device and join:
        torch.cuda.current_stream().synchronize()
    logger.debug("snapshot of %d layers at step %d", len(shards), step)
    return shards


def _copy_out(layout: StateLayout, pieces: Sequence[Piece], key: str, pool: HostBufferPool) -> torch.Tensor:
    buffer = pool.acquire(sum(p.slice.length for p in pieces))
    runs = state_runs(layout.optimizer, pieces, key)
    if runs and not any(run.is_cuda for run in runs):  # on the host: one call, not a view and a copy per run
        torch.cat(runs, out=buffer)
        return buffer
    start = 0
    for run in runs:
        n = run.numel()
        buffer.narrow(0, start, n).copy_(run, non_blocking=True)
        start += n
    return buffer


@torch.no_grad()
def restore_layers(layout: StateLayout, metas: Mapping[str, LayerMetaView], read: RangeReader) -> None:
    """Load the layers named in ``metas`` from ``read``; other layers stay as they are.

    Collective at ZeRO 1-3 (the low-precision weights are re-gathered): every rank must call
    it at the same point, each with the layers it restores (possibly none).
    """
    for name, meta in metas.items():
        entry = layout[name]
        for piece in entry.needed:
            s = piece.slice
            for key in STATE_KEYS:
                source = read(s.name, key, s.offset, s.length)
                if source.numel() != s.length:
                    raise ValueError(f"reader gave {source.numel()} elements of {s.name!r} {key}, wanted {s.length}")
                state_view(layout.optimizer, piece, key).copy_(source.reshape(-1))
        for master in entry.masters:
            # a master shared with other layers (param groups not layer-aligned) keeps the newest count
            shared = sum(master is m for other in metas for m in layout[other].masters) > 1
            count = max(meta.optimizer_step, _restored_count(layout, metas, master)) if shared else meta.optimizer_step
            optim_state.set_step(layout.optimizer, master, count)
        _restore_hyperparameters(layout, entry, meta.groups)
    refresh_forward_weights(layout, list(metas))
    logger.info("restored %d layers: %s", len(metas), ", ".join(metas))


def _restored_count(layout: StateLayout, metas: Mapping[str, LayerMetaView], master: torch.Tensor) -> int:
    """The newest step count among the restored layers that share ``master``: one Adam count
    serves them all, and bias correction barely changes past the first steps."""
    return max(meta.optimizer_step for name, meta in metas.items() if any(m is master for m in layout[name].masters))


def _restore_hyperparameters(layout: StateLayout, entry: LayerLayout, groups: Sequence[Mapping[str, Any]]) -> None:
    by_name = {g["name"]: g for g in groups if "name" in g}
    by_index = {g["index"]: g for g in groups if "index" in g}
    for group, index in zip(layout.groups_of(entry.name), entry.group_indices):
        source = by_name.get(group["name"]) if "name" in group else by_index.get(index)
        if source is None:
            continue
        for key in RESTORED_HYPERPARAMETERS:
            if key in source:
                value = tuple(source[key]) if isinstance(group.get(key), tuple) else source[key]
                if group.get(key) != value:
                    logger.info(
                        "group %s: %s %s -> %s (restored)", group.get("name", index), key, group.get(key), value
                    )
                group[key] = value


class ShardReader:
    """A :data:`RangeReader` over in-memory :class:`LayerShard` s of any world size or slicing."""

    def __init__(self, shards: Iterable[LayerShard]) -> None:
        self._pieces: dict[str, list[tuple[int, int, LayerShard, int]]] = {}
        for shard in shards:
            for index, s in enumerate(shard.slices):
                if s.length:
                    self._pieces.setdefault(s.name, []).append((s.offset, s.length, shard, index))
        for pieces in self._pieces.values():
            pieces.sort(key=lambda p: p[0])

    def __call__(self, name: str, key: str, offset: int, length: int) -> torch.Tensor:
        parts: list[torch.Tensor] = []
        position, end = offset, offset + length
        for start, n, shard, index in self._pieces.get(name, []):
            if start <= position < start + n:
                take = min(end, start + n) - position
                parts.append(shard.view(key, index).narrow(0, position - start, take))
                position += take
                if position == end:
                    break
        if position < end:
            raise KeyError(f"no shard holds elements [{position}, {end}) of {name!r}")
        return parts[0] if len(parts) == 1 else torch.cat(parts)


def metas_of(shards: Iterable[LayerShard]) -> dict[str, LayerMeta]:
    """The per-layer metadata of ``shards``; shards of one layer must come from one version."""
    metas: dict[str, LayerMeta] = {}
    steps: dict[str, int] = {}
    for shard in shards:
        meta = LayerMeta(optimizer_step=shard.optimizer_step, groups=shard.groups)
        if shard.layer in metas and (steps[shard.layer], metas[shard.layer].optimizer_step) != (
            shard.step,
            meta.optimizer_step,
        ):
            raise ValueError(f"shards of layer {shard.layer!r} come from different steps")
        metas.setdefault(shard.layer, meta)
        steps.setdefault(shard.layer, shard.step)
    return metas


def restore_from_shards(layout: StateLayout, shards: Sequence[LayerShard]) -> None:
    """Restore every layer present in ``shards``. They must cover :func:`needed_slices`: at
    ZeRO 1-3 with the same world size a rank's own shards do; at ZeRO-0 pass all ranks' shards."""
    restore_layers(layout, metas_of(shards), ShardReader(shards))
