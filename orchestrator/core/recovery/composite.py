"""Loading a composite into a live engine: each rank reads only its own slices of the chosen
versions, straight from the store, whatever world size they were written at — each element from
the newest partial version overlaid on its layer that holds it (a survivor's capture), else
from the layer's whole version."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping
from typing import Protocol

import torch

from layercheck.orchestrator.store.composite_reader import CompositeReader
from layercheck.orchestrator.store.errors import CorruptShardError
from layercheck.orchestrator.store.layer_store import LayerStore
from layercheck.orchestrator.store.manifest import VersionRecord
from layercheck.policies.layer_map import LayerMap, describe_layers
from layercheck.workers import optim_state
from layercheck.workers.host_buffers import HostBufferPool
from layercheck.workers.layer_state import ShardReader, group_metadata, restore_layers, snapshot_layers
from layercheck.workers.layout import StateLayout

logger = logging.getLogger(__name__)


class CompositeMismatchError(ValueError):
    """A stored version does not hold the model's parameters with the model's shapes."""


def check_fits(reader: CompositeReader, records: Mapping[str, VersionRecord], layer_map: LayerMap) -> None:
    """Raise :class:`CompositeMismatchError` unless each layer's version holds exactly the
    model's parameters of that layer, with the model's shapes: a config for another model would
    otherwise load the first elements of each tensor without complaint."""
    for layer in layer_map.layers:
        if layer.name not in records:
            continue
        wanted = {p.name: tuple(p.shape) for p in layer.params}
        for partial in reader.overlay_readers(layer.name):
            # a partial version holds only some parameters' slices: each must be the model's
            odd = sorted(n for n, shape in partial.param_shapes.items() if wanted.get(n) != shape)
            if odd:
                raise CompositeMismatchError(
                    f"partial version {partial.record.version_id} of layer {layer.name} does not fit the run "
                    f"config's model ({'; '.join(f'{n}: stored {partial.param_shapes[n]}, model {wanted.get(n)}' for n in odd)})"
                )
        stored = reader.reader(layer.name).param_shapes
        if stored != wanted:
            diff = sorted(
                f"{name}: stored {stored.get(name)}, model {wanted.get(name)}"
                for name in set(stored) | set(wanted)
                if stored.get(name) != wanted.get(name)
            )
            raise CompositeMismatchError(
                f"version {records[layer.name].version_id} of layer {layer.name} does not "
                f"fit the run config's model ({'; '.join(diff)})"
            )


class Restorable(Protocol):
    """What a composite loads into: the built-in ``TrainEngine`` or an attached user engine."""

    layer_map: LayerMap
    layout: StateLayout


def load_composite(
    train_engine: Restorable,
    store: LayerStore,
    records: Mapping[str, VersionRecord],
    *,
    overlays: Mapping[str, tuple[VersionRecord, ...]] | None = None,
) -> float:
    """Restore every layer in ``records`` from its version (collective at ZeRO 1-3), with the
    partial ``overlays`` of each layer (newest first) taking the elements they hold; seconds taken.

    Raises :class:`CompositeMismatchError` (before touching the engine) if a version does not fit
    the model, and :class:`~layercheck.orchestrator.store.errors.CorruptShardError` naming the version if a
    tensor fails its checksum — only after this rank took part in the load's collective, which
    its peers (whose slices may be sound) are waiting in; the engine then holds garbage.
    """
    started = time.monotonic()
    records, initial = _without_initial(train_engine, records, overlays or {})
    with CompositeReader(store, records, overlays=overlays, bases=initial) as reader:
        check_fits(reader, records, train_engine.layer_map)
        guarded = _UntilCorrupt(reader)
        restore_layers(train_engine.layout, reader.metas(), guarded)
    if guarded.error is not None:
        raise guarded.error
    probe = getattr(train_engine, "probe", None)
    if probe is not None and hasattr(probe, "reset"):
        probe.reset()  # the restore moved the weights: that is no step's drift
    elapsed = time.monotonic() - started
    logger.info(
        "loaded a composite of %d layers (%d with partial versions overlaid) in %.2fs",
        len(records),
        sum(1 for layer in records if (overlays or {}).get(layer)),
        elapsed,
    )
    return elapsed


class InitialStateError(RuntimeError):
    """A composite takes a layer from the run's rebuilt initial state, but the engine has trained."""


def _without_initial(
    train_engine: Restorable,
    records: Mapping[str, VersionRecord],
    overlays: Mapping[str, tuple[VersionRecord, ...]],
) -> tuple[dict[str, VersionRecord], dict[str, InitialBase]]:
    """``records`` less the layers that come from the run's rebuilt initial state (see
    :mod:`~layercheck.orchestrator.store.initial_state`): this freshly built engine already holds
    that state, so such a layer is left as it is — unless partial versions (a survivor's capture)
    are overlaid on it: then it stays in the composite, its remaining elements read from the
    engine itself (:class:`InitialBase`). Raises :class:`InitialStateError` for an engine that has
    trained: its state is no longer the initial one."""
    initial = [layer for layer, record in records.items() if record.is_initial]
    if not initial:
        return dict(records), {}
    layout = train_engine.layout
    trained = layout.steps_taken()
    if trained != 0:
        raise InitialStateError(
            f"cannot take {describe_layers(initial)} from the initial state: this engine has trained "
            f"{trained} step(s); build a fresh one to recover into"
        )
    kept = {layer: record for layer, record in records.items() if not record.is_initial}
    overlaid = [layer for layer in initial if overlays.get(layer)]
    bases = {layer: InitialBase(train_engine, layer) for layer in overlaid}
    kept.update({layer: records[layer] for layer in overlaid})
    logger.info(
        "%s from the initial state as rebuilt (%d of them under partial versions)",
        describe_layers(initial),
        len(overlaid),
    )
    return kept, bases


class InitialBase:
    """The whole version a composite reads for a layer that comes from the initial state: this
    rank's own freshly built state of the layer (every range a restore asks of it; zero moments),
    copied out before the restore overwrites it."""

    def __init__(self, train_engine: Restorable, layer: str) -> None:
        layout = train_engine.layout
        entry = layout[layer]
        for master in entry.masters:
            optim_state.init_state(layout.optimizer, master)  # a fresh optimizer may have no moments yet
        shards = snapshot_layers(layout, [layer], HostBufferPool(), step=0, pieces={layer: entry.needed})
        self._read = ShardReader(shards)
        self.param_shapes = {p.name: tuple(p.shape) for p in train_engine.layer_map[layer].params}
        self.optimizer_step = 0
        self.groups = group_metadata(layout, layer)

    def read(self, param: str, key: str, offset: int, length: int) -> torch.Tensor:
        return self._read(param, key, offset, length).clone()

    def close(self) -> None:
        pass


class _UntilCorrupt:
    """A range reader that, once a version turns out corrupt, keeps the error and hands out NaN
    for every later range, so the restore still reaches its collective."""

    def __init__(self, read: CompositeReader) -> None:
        self.read = read
        self.error: CorruptShardError | None = None

    def __call__(self, param: str, key: str, offset: int, length: int) -> torch.Tensor:
        if self.error is None:
            try:
                return self.read(param, key, offset, length)
            except CorruptShardError as error:
                self.error = error
        return torch.full((length,), math.nan)
