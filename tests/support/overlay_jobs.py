"""Per-rank job of the capture-overlay test (spawned by tests/support/dist_harness.py).

Two ZeRO-3 ranks train the composite tests' tiny Llama; every layer is persisted whole at step
``S``; at step ``T`` rank 0 alone hands over its slices of every layer as a *capture* (a partial
version: what a survivor holds when its peer dies). Recovery at ``t_fail = T`` must then give
rank 0's slices at their step-``T`` values and rank 1's at their step-``S`` values, bit for bit.
The expected values are gathered with DeepSpeed's public ``safe_get_full_*`` helpers.
"""

from __future__ import annotations

from typing import Any

import torch

from layercheck.orchestrator.store.layer_store import LayerStore
from layercheck.workers.engine import TrainEngine, shutdown
from layercheck.workers.host_buffers import HostBufferPool
from layercheck.workers.layer_state import snapshot_layers
from layercheck.workers.step import train_step
from tests.support.composite_jobs import adam_steps, make_engine, run_config
from tests.support.engines import batches, full_state

S, T = 2, 4


def _write(
    train_engine: TrainEngine,
    store: LayerStore,
    pool: HostBufferPool,
    *,
    capture: bool,
    layers: tuple[str, ...] | list[str] | None = None,
) -> list[tuple]:
    """Every rank snapshots ``layers`` (default: every layer); all ranks' shards (``capture``:
    rank 0's only) are committed, by rank 0. Returns the (param, offset, length) slices this rank wrote."""
    names = list(train_engine.layer_map.names if layers is None else layers)
    rank = torch.distributed.get_rank()
    shards = snapshot_layers(train_engine.layout, names, pool)
    mine = [(s.name, s.offset, s.length) for shard in shards for s in shard.slices]
    send = not capture or rank == 0
    receipts = [store.write_shard(s, base=not capture, origin="capture" if capture else "policy") for s in shards]
    for shard in shards:
        pool.release(shard)
    everyone: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(everyone, receipts if send else None)
    if rank == 0:
        for i in range(len(names)):
            store.commit([r[i] for r in everyone if r is not None], partial=capture)
    torch.distributed.barrier()
    return mine if send else []


def capture_overlay_job(rank: int, world_size: int, store_uri: str) -> dict[str, Any]:
    from layercheck.orchestrator.core.recovery.composite import load_composite
    from layercheck.orchestrator.store.recovery_source import resolve_plan

    train_engine = make_engine(run_config())
    names = list(train_engine.layer_map.names)
    store, pool = LayerStore.open(store_uri, fsync=False), HostBufferPool()
    for t in range(1, T + 2):
        train_step(train_engine, batches(train_engine, t, rank))
        if t == S:
            _write(train_engine, store, pool, capture=False)
            at_s = full_state(train_engine, names)
        if t == T:
            captured = _write(train_engine, store, pool, capture=True)
            at_t = full_state(train_engine, names)
    # the engine is now at T + 1: it holds neither state, as a fresh group's would not
    resolved = resolve_plan(store, train_engine.layer_map.numel, T)
    load_composite(train_engine, store, resolved.records, overlays=resolved.overlays)
    got = full_state(train_engine, names)
    out: dict[str, Any] = {
        "adam_steps": adam_steps(train_engine),
        "sources": {layer: [s.to_json() for s in sources] for layer, sources in resolved.sources.items()},
        "max_staleness": resolved.plan.max_staleness,
        "captured_elements": sum(length for _, _, length in captured),
    }
    shutdown(train_engine)
    if rank == 0:
        out.update(_compare(at_s, at_t, got, captured))
    return out


def _compare(at_s: dict, at_t: dict, got: dict, captured: list[tuple]) -> dict[str, Any]:
    """Rank 0's slices (``captured``) must hold their values at T, every other element its value at S."""
    expected = {k: v.clone() for k, v in at_s.items()}
    in_capture = {k: torch.zeros_like(v, dtype=torch.bool) for k, v in at_s.items()}
    for name, offset, length in captured:
        for key in ("fp32", "exp_avg", "exp_avg_sq"):
            expected[f"{key}/{name}"][offset : offset + length] = at_t[f"{key}/{name}"][offset : offset + length]
            in_capture[f"{key}/{name}"][offset : offset + length] = True
    return {
        "mismatches": sorted(k for k in expected if not torch.equal(got[k], expected[k])),
        # the check means something only if both parts moved between S and T
        "captured_moved": sum(int((at_t[k] != at_s[k])[in_capture[k]].sum()) for k in at_s),
        "rest_moved": sum(int((at_t[k] != at_s[k])[~in_capture[k]].sum()) for k in at_s),
        "rest_elements": sum(int((~in_capture[k]).sum()) for k in at_s if k.startswith("fp32/")),
    }


#: The initial-state job: these layers are persisted whole at S; rank 0 captures every layer but
#: the last at T, so that one comes from the initial state alone, the others' rank-1 slices from
#: their version at S or, for the layers never saved, from the initial state.
SAVED_AT_S = ("embed", "block.0")


def initial_overlay_job(rank: int, world_size: int, store_uri: str) -> dict[str, Any]:
    """A store whose run recorded its initial state (``initial.json``): recovery at T into a fresh
    engine takes each never-saved layer from that engine's own rebuilt state, under rank 0's capture."""
    from layercheck.orchestrator.core.recovery.composite import load_composite
    from layercheck.orchestrator.store.initial_state import record_initial
    from layercheck.orchestrator.store.recovery_source import resolve_plan

    config = run_config()
    train_engine = make_engine(config)
    names = list(train_engine.layer_map.names)
    store, pool = LayerStore.open(store_uri, fsync=False), HostBufferPool()
    if rank == 0:
        record_initial(store.fs, names)
    at_0 = {k: v for k, v in full_state(train_engine, names).items() if k.startswith("fp32/")}
    captured_names = names[:-1]
    saved_params = {p.name for layer in SAVED_AT_S for p in train_engine.layer_map[layer].params}
    for t in range(1, T + 2):
        train_step(train_engine, batches(train_engine, t, rank))
        if t == S:
            _write(train_engine, store, pool, capture=False, layers=SAVED_AT_S)
            at_s = full_state(train_engine, names)
        if t == T:
            captured = _write(train_engine, store, pool, capture=True, layers=captured_names)
            at_t = full_state(train_engine, names)
    shutdown(train_engine)
    fresh = make_engine(config)  # what a restarted worker builds: the same initial state
    resolved = resolve_plan(store, fresh.layer_map.numel, T)
    load_composite(fresh, store, resolved.records, overlays=resolved.overlays)
    got = full_state(fresh, names)
    out: dict[str, Any] = {
        "adam_steps": adam_steps(fresh),
        "versions": {layer: record.version_id for layer, record in resolved.records.items()},
        "sources": {layer: [s.to_json() for s in sources] for layer, sources in resolved.sources.items()},
        "max_staleness": resolved.plan.max_staleness,
    }
    shutdown(fresh)
    if rank == 0:
        initial = {k: torch.zeros_like(v) for k, v in at_s.items()} | at_0  # zero moments
        expected = {k: (at_s[k] if k.split("/", 1)[1] in saved_params else initial[k]).clone() for k in at_s}
        for name, offset, length in captured:
            for key in ("fp32", "exp_avg", "exp_avg_sq"):
                k = f"{key}/{name}"
                expected[k][offset : offset + length] = at_t[k][offset : offset + length]
        out["mismatches"] = sorted(k for k in expected if not torch.equal(got[k], expected[k]))
        out["moved_from_initial"] = sum(int((at_t[k] != at_0[k]).sum()) for k in at_0)
    return out
