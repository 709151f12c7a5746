"""The run's initial state as every layer's version at step 0, recorded at no write cost.

A run whose workers rebuild the same initial state on every start — ``layercheck train``'s
built-in loop builds its model from the run config (a seeded initialisation or the same
pretrained files) and a fresh optimizer (zero moments) — records that fact once, in
``initial.json`` beside ``run.json``, instead of writing a checkpoint. From then on a layer that
has no stored version yet is not a hole in the composite: recovery (and ``--resume``, and
``export``) takes it from the rebuilt state, its staleness counted from step 0 like any other
layer's. So a failure before a layer's first save still resumes at ``t_fail + 1``.

The placeholder :class:`VersionRecord` of such a layer (:func:`initial_record`, origin
``initial``, no shard files) lives only in plans; the manifest never holds one.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Collection
from dataclasses import dataclass

from layercheck.orchestrator.store.errors import ManifestError
from layercheck.orchestrator.store.fs import StoreFS
from layercheck.orchestrator.store.manifest import VersionRecord, check_layer_name
from layercheck.policies.plan import INITIAL_ORIGIN

logger = logging.getLogger(__name__)

INITIAL_FILE = "initial.json"
INITIAL_FORMAT = "layercheck.initial/1"
#: How the initial state comes back: rebuilt by the run's own code (the only kind so far).
REBUILD = "rebuild"


@dataclass(frozen=True)
class InitialState:
    """What ``initial.json`` says: which layers' step-0 state the run rebuilds, and how."""

    layers: tuple[str, ...]
    source: str = REBUILD

    def records(self, layers: Collection[str] | None = None) -> dict[str, VersionRecord]:
        """The placeholder record of each of ``layers`` (default: all) this state covers."""
        names = self.layers if layers is None else [name for name in layers if name in self.layers]
        return {name: initial_record(name) for name in names}


def initial_record(layer: str) -> VersionRecord:
    """Layer ``layer``'s state at step 0 as the run rebuilds it: no files, nothing to read."""
    return VersionRecord(
        version_id=f"{layer}@initial",
        layer=layer,
        step=0,
        world_size=0,
        base=True,
        committed_at=0.0,
        shards=(),
        origin=INITIAL_ORIGIN,
    )


def record_initial(fs: StoreFS, layers: Collection[str]) -> None:
    """Record that the run rebuilds every layer of ``layers`` at step 0 (a fresh run's start)."""
    names = [check_layer_name(name) for name in layers]
    fs.write_bytes(INITIAL_FILE, json.dumps({"format": INITIAL_FORMAT, "source": REBUILD, "layers": names}).encode())


def read_initial(fs: StoreFS) -> InitialState | None:
    """The run's recorded initial state; ``None`` if it recorded none (a user's own loop, whose
    start LayerCheck cannot rebuild, or a store written before this file existed). A damaged file
    raises :class:`ManifestError` naming it: recovering without it would restart from step 1."""
    try:
        raw = fs.read_bytes(INITIAL_FILE)
    except FileNotFoundError:
        return None
    where = fs.uri(INITIAL_FILE)
    try:
        data = json.loads(raw)
        if data.get("format") != INITIAL_FORMAT:
            raise ValueError(f"format is {data.get('format')!r}, expected {INITIAL_FORMAT!r}")
        if data.get("source") != REBUILD:
            raise ValueError(f"source is {data.get('source')!r}, expected {REBUILD!r}")
        layers = tuple(check_layer_name(str(name)) for name in data["layers"])
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise ManifestError(f"{where}: not a valid initial-state record ({error}); restore it or delete it") from None
    return InitialState(layers=layers)
