"""The recovery plan over a long run's history: a store holding ``versions`` committed versions of
a model's layers (N rank files each), planned three ways, each timed and its store requests counted:

* ``read``: the store's manifest as the plan read it before the supervisor kept its own
  (``store.manifest()``: one listing of ``manifest/``, a GET per record);
* ``plan``: the plan on that manifest (the chosen versions' files checked: a header per rank file);
* ``kept``: the plan as the supervisor makes it now, from the versions it knows
  (``core/recovery/known_versions.py``: the store's history was read at the run's start).

Only the newest version of each layer has files (the ones a plan at the newest step checks); the
older records name files that were never written, which no plan at that step opens."""

from __future__ import annotations

import dataclasses
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pyarrow.fs as pafs

from layercheck.bench.scale import countfs
from layercheck.bench.scale.shapes import SHAPES, scaled_numel
from layercheck.bench.scale.synthetic import SyntheticRank
from layercheck.orchestrator.core.recovery.events import PlanComposite
from layercheck.orchestrator.core.recovery.known_versions import KnownVersions
from layercheck.orchestrator.core.recovery.plan_composite import plan_composite
from layercheck.orchestrator.store.fs import StoreFS, new_token
from layercheck.orchestrator.store.layer_store import LayerStore
from layercheck.orchestrator.store.manifest import VersionRecord, encode_record, record_path
from layercheck.orchestrator.store.recovery_source import resolve_plan
from layercheck.workers.host_buffers import HostBufferPool
from layercheck.workers.layer_state import snapshot_layers

#: Ranks of every version (its rank files); a plan checks this many headers per layer.
RANKS = 8


def build_history(store: LayerStore, numel: dict[str, int], versions: int, *, ranks: int = RANKS) -> int:
    """Commit ``versions`` versions, layer after layer, step after step: the newest of each layer
    written and committed for real, the older ones as records only. Returns the newest step."""
    layers = list(numel)
    steps = -(-versions // len(layers))
    rank_states = [SyntheticRank(numel, rank=r, world_size=ranks) for r in range(ranks)]
    pool = HostBufferPool()
    newest: dict[str, VersionRecord] = {}
    for layer in layers:
        receipts = [
            store.write_shard(shard)
            for state in rank_states
            for shard in snapshot_layers(state.layout, [layer], pool, step=steps)
        ]
        newest[layer] = store.commit(receipts)
    older = [(layers[i % len(layers)], 1 + i // len(layers)) for i in range(versions - len(layers))]

    def commit_record(item: tuple[str, int]) -> None:
        layer, step = item
        template = newest[layer]
        shards = tuple(
            dataclasses.replace(
                entry, path=f"layers/{layer}/{step:010d}-rank{entry.rank:05d}of{ranks:05d}-{new_token()}.safetensors"
            )
            for entry in template.shards
        )
        record = dataclasses.replace(
            template, version_id=f"{layer}@{step:010d}-{new_token()}", step=step, shards=shards
        )
        store.fs.write_bytes(record_path(record.version_id), encode_record(record))

    with ThreadPoolExecutor(max_workers=8) as threads:
        list(threads.map(commit_record, older))
    return steps


def _counted(root: str) -> LayerStore:
    """The store at ``root``, its requests counted (once: in a process where :func:`countfs.install`
    ran, every store is counted already)."""
    opened = StoreFS.open(root, fsync=False)
    if opened.fs.type_name.startswith("py::counting"):
        return LayerStore(opened)
    return LayerStore(dataclasses.replace(opened, fs=pafs.PyFileSystem(countfs.CountingHandler(opened.fs))))


def plan_over_versions(versions: int, *, shape: str, scale: int, root: Path) -> dict[str, Any]:
    """Build a history of ``versions`` versions under ``root`` and time its plan (see the module)."""
    numel = scaled_numel(SHAPES[shape], scale)
    where = root / f"history-{versions}"
    started = time.monotonic()
    steps = build_history(LayerStore.open(str(where), fsync=False), numel, versions)
    built_s = time.monotonic() - started

    def measured(action: Any) -> tuple[float, dict[str, int], Any]:
        before = countfs.snapshot()
        began = time.monotonic()
        result = action()
        return time.monotonic() - began, countfs._minus(countfs.snapshot(), before), result

    store = _counted(str(where))
    read_s, read_requests, manifest = measured(store.manifest)
    plan_s, plan_requests, resolved = measured(lambda: resolve_plan(store, numel, None, deep=False, manifest=manifest))
    known = KnownVersions()
    known.load(store)  # (the run's start)
    kept_s, kept_requests, planned = measured(
        lambda: plan_composite(store, numel, PlanComposite(attempt=2, t_fail=steps), manifest=known.manifest(store))
    )
    return {
        "versions": len(manifest.records),
        "n_ranks": RANKS,
        "layers": len(numel),
        "build_s": built_s,
        "read_s": read_s,
        "requests": read_requests,
        "plan_s": plan_s,
        "plan_requests": plan_requests,
        "kept_plan_s": kept_s,
        "kept_requests": kept_requests,
        "t_fail": resolved.plan.t_fail,
        "kept_t_fail": getattr(planned, "t_fail", None),
    }
