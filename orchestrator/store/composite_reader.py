"""The composite of a recovery plan as one range reader over all its layers.

Each layer's elements come from its whole version, except where partial versions overlaid on
it (a survivor's capture, newest first) hold them: a range read takes the covered elements from
the newest overlay holding them and fills the gaps from the whole version.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from layercheck.orchestrator.store.layer_store import LayerStore
from layercheck.orchestrator.store.manifest import VersionRecord
from layercheck.orchestrator.store.recovery_source import VersionReader
from layercheck.policies.overlay import Claim, claim, claimed_elements


@dataclass(frozen=True, kw_only=True)
class VersionMeta:
    """The per-layer part of a version (what ``layercheck.workers.layer_state.LayerMeta`` holds)."""

    optimizer_step: int
    groups: tuple[dict[str, Any], ...]


class BaseReader(Protocol):
    """What a layer's whole version is read through: a :class:`VersionReader`, or a stand-in."""

    @property
    def param_shapes(self) -> dict[str, tuple[int, ...]]: ...

    @property
    def optimizer_step(self) -> int: ...

    @property
    def groups(self) -> tuple[dict[str, Any], ...]: ...

    def read(self, param: str, key: str, offset: int, length: int) -> torch.Tensor: ...

    def close(self) -> None: ...


class CompositeReader:
    """``reader(param, key, offset, length)`` — the ``RangeReader`` that
    ``layercheck.workers.layer_state.restore_layers`` takes — with :meth:`metas` for its ``metas``.

    A tensor that fails its checksum raises
    :class:`~layercheck.orchestrator.store.errors.CorruptShardError` naming the version it belongs to,
    whole or overlaid, so the next plan can skip exactly that one."""

    def __init__(
        self,
        store: LayerStore,
        records: Mapping[str, VersionRecord],
        *,
        overlays: Mapping[str, tuple[VersionRecord, ...]] | None = None,
        bases: Mapping[str, BaseReader] | None = None,
    ) -> None:
        """``bases``: per layer, a reader that stands in for its whole version (the rebuilt
        initial state, which has no files); its record in ``records`` is not read."""
        bases = bases or {}
        self._readers: dict[str, BaseReader] = {
            layer: bases[layer] if layer in bases else VersionReader(store, record) for layer, record in records.items()
        }
        self._overlays = {
            layer: [VersionReader(store, record) for record in (overlays or {}).get(layer, ())] for layer in records
        }
        self._claims: dict[str, dict[str, tuple[Claim, ...]]] = {}
        self._layer_of: dict[str, str] | None = None

    def __enter__(self) -> CompositeReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for reader in [*self._readers.values(), *(r for rs in self._overlays.values() for r in rs)]:
            reader.close()

    def reader(self, layer: str) -> BaseReader:
        """The reader of ``layer``'s whole version."""
        return self._readers[layer]

    def overlay_readers(self, layer: str) -> list[VersionReader]:
        """The readers of the partial versions overlaid on ``layer``, newest first."""
        return self._overlays[layer]

    def claims(self, layer: str) -> dict[str, tuple[Claim, ...]]:
        """param → which overlay (index, newest first) supplies which elements of ``layer``."""
        if layer not in self._claims:
            self._claims[layer] = claim([r.coverage() for r in self._overlays[layer]])
        return self._claims[layer]

    def metas(self, layers: Collection[str] | None = None) -> dict[str, VersionMeta]:
        names = self._readers if layers is None else layers
        return {name: self._meta(name) for name in names}

    def _meta(self, layer: str) -> VersionMeta:
        # One optimizer step and one set of param-group settings per layer, though its elements
        # may come from several steps: the newest source that supplies any element gives them.
        # Those elements are exactly as training left them at t_fail (or nearest before), and the
        # run resumes at t_fail + 1 — Adam's bias correction then matches the freshest moments,
        # and for the older elements it differs only by 1 - beta^step factors that vanish as
        # training goes on (a whole version's step is no better for them: it is just as off
        # for the fresher elements).
        overlays = self._overlays[layer]
        counts = claimed_elements(self.claims(layer), len(overlays))
        newest = next((r for r, n in zip(overlays, counts, strict=True) if n > 0), self._readers[layer])
        return VersionMeta(optimizer_step=newest.optimizer_step, groups=newest.groups)

    def __call__(self, param: str, key: str, offset: int, length: int) -> torch.Tensor:
        if self._layer_of is None:
            self._layer_of = {p: layer for layer, r in self._readers.items() for p in r.param_shapes}
        layer = self._layer_of.get(param)
        if layer is None:
            raise KeyError(f"no layer of the composite holds parameter {param!r}")
        base = self._readers[layer]
        claims = self.claims(layer).get(param, ()) if self._overlays[layer] else ()
        if not claims:
            return base.read(param, key, offset, length)
        out = torch.empty(length, dtype=torch.float32)
        position, end = offset, offset + length
        for c in claims:
            if c.end <= position:
                continue
            if c.start >= end:
                break
            if c.start > position:  # a gap no overlay holds: the whole version's elements
                out[position - offset : c.start - offset] = base.read(param, key, position, c.start - position)
                position = c.start
            stop = min(c.end, end)
            out[position - offset : stop - offset] = self._overlays[layer][c.source].read(
                param, key, position, stop - position
            )
            position = stop
        if position < end:
            out[position - offset :] = base.read(param, key, position, end - position)
        return out
