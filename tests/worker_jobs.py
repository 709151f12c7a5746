"""Per-rank jobs for the worker tests (spawned by tests/dist_harness.py; must be importable).

Each job builds a real DeepSpeed engine on a tiny Llama and checks several properties in one
process start, returning plain values for the test to assert on.
"""

from __future__ import annotations

from typing import Any

import torch

from workers.config import EngineConfig, ModelConfig, OptimConfig
from workers.engine import TrainEngine, build_engine, seek_step, shutdown
from workers.host_buffers import HostBufferPool
from workers.layer_state import needed_slices, restore_from_shards, snapshot_layers
from workers.drift import global_drift
from workers.step import eval_loss, train_step
from workers.shard import STATE_KEYS, LayerShard

TINY_LLAMA: dict[str, Any] = {
    "model_type": "llama", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "max_position_embeddings": 64, "tie_word_embeddings": False,
}
SEQ = 16


def make_engine(stage: int, precision: str, micro_batch: int = 2, grad_accum: int = 1) -> TrainEngine:
    return build_engine(
        ModelConfig(hf_config=TINY_LLAMA, seed=7),
        OptimConfig(lr=3e-3, weight_decay=0.1, warmup_steps=2, total_steps=20, min_lr_ratio=0.1, schedule="cosine"),
        EngineConfig(zero_stage=stage, precision=precision, micro_batch=micro_batch, grad_accum=grad_accum, grad_clip=1.0),
    )


def batches(te: TrainEngine, step: int, rank: int) -> list[torch.Tensor]:
    """The micro-batches rank ``rank`` trains on at ``step`` (a pure function of both)."""
    out = []
    for micro in range(te.engine.gradient_accumulation_steps()):
        g = torch.Generator().manual_seed(100_000 * step + 100 * micro + rank)
        out.append(torch.randint(0, TINY_LLAMA["vocab_size"], (te.engine_cfg.micro_batch, SEQ), generator=g))
    return out


def probe_batch() -> torch.Tensor:
    g = torch.Generator().manual_seed(424242)
    return torch.randint(0, TINY_LLAMA["vocab_size"], (2, SEQ), generator=g)


def full_fp32(te: TrainEngine, name: str) -> torch.Tensor:
    """The whole fp32 master of parameter ``name``, through DeepSpeed's public helpers where
    they exist (collective at ZeRO-3): an independent reference for the layout code."""
    import deepspeed

    from workers import ds_internals

    param = dict(te.engine.module.named_parameters())[name]
    if te.engine_cfg.zero_stage == 0:
        master = {id(lp): hp for lp, hp in ds_internals.zero0_master_pairs(te.engine)}[id(param)]
        return master.detach().clone().float().view(-1)
    return deepspeed.utils.safe_get_full_fp32_param(param).detach().clone().float().view(-1)


def all_full_fp32(te: TrainEngine) -> dict[str, torch.Tensor]:
    return {p.name: full_fp32(te, p.name) for layer in te.layer_map.layers for p in layer.params}


def shard_values(shards: list[LayerShard]) -> dict[str, Any]:
    return {s.layer: {k: s.tensors[k].clone() for k in STATE_KEYS} | {"step": s.optimizer_step} for s in shards}


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return all(torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a)


def gather_shards(shards: list[LayerShard]) -> list[LayerShard]:
    """Every rank's shards (ZeRO-0 restore needs whole parameters); in-memory test transport."""
    everyone: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(everyone, shards)
    return [s for rank_shards in everyone for s in rank_shards]


def drift_and_roundtrip_job(rank: int, world_size: int, stage: int, precision: str, grad_accum: int) -> dict[str, Any]:
    """Drift vs snapshot-and-diff; snapshot → train → restore reproduces the trajectory;
    the forward reads restored weights; a partial restore touches only its layers."""
    te = make_engine(stage, precision, grad_accum=grad_accum)
    pool = HostBufferPool()
    layers = list(te.layer_map.names)
    out: dict[str, Any] = {"groups": [(g["name"], g["weight_decay"], g["lr"]) for g in te.optimizer.param_groups]}
    out["numel"] = te.probe.numel
    out["layer_numel"] = te.layer_map.numel

    # 1. Drift: the probe against a local snapshot-and-diff and a global full-parameter diff.
    local_pairs, global_pairs = [], []
    k = 3
    for t in range(k):
        before_local = shard_values(snapshot_layers(te.layout, layers, pool))
        before_full = all_full_fp32(te)
        _, drift = train_step(te, batches(te, t, rank))
        after_local = shard_values(snapshot_layers(te.layout, layers, pool))
        after_full = all_full_fp32(te)
        for name in layers:
            ref = float((after_local[name]["fp32"] - before_local[name]["fp32"]).abs().double().sum())
            local_pairs.append((name, drift.l1[name], ref))
        reduced = global_drift(drift)
        for layer in te.layer_map.layers:
            diff = sum(float((after_full[p.name] - before_full[p.name]).abs().double().sum()) for p in layer.params)
            global_pairs.append((layer.name, reduced[layer.name], diff / layer.numel))
    out["local_drift"], out["global_drift"] = local_pairs, global_pairs

    # 2. Round trip: snapshot at k, train n, restore, train the same n again.
    snap = snapshot_layers(te.layout, layers, pool)
    snap_values = shard_values(snap)
    loss_at_snap = eval_loss(te, probe_batch())
    n = 3
    first = [train_step(te, batches(te, k + i, rank)) for i in range(n)]
    current = snapshot_layers(te.layout, layers, pool)
    current_values = shard_values(current)
    pool.release(current[0])  # exercise reuse: the next same-sized snapshot takes this buffer back
    restore_from_shards(te.layout, gather_shards(snap) if stage == 0 else snap)
    seek_step(te, k)
    out["loss_at_snapshot"] = (loss_at_snap, eval_loss(te, probe_batch()))
    out["restored_equals_snapshot"] = all(
        same(v, snap_values[name]) for name, v in shard_values(snapshot_layers(te.layout, layers, pool)).items())
    second = [train_step(te, batches(te, k + i, rank)) for i in range(n)]
    out["losses"] = ([l for l, _ in first], [l for l, _ in second])
    out["drifts"] = ([dict(d.l1) for _, d in first], [dict(d.l1) for _, d in second])
    out["end_state_equal"] = all(
        same(v, current_values[name]) for name, v in shard_values(snapshot_layers(te.layout, layers, pool)).items())

    # 3. Mixed: restore only some layers from the older snapshot.
    chosen = [layers[0], layers[2]]
    restore_from_shards(te.layout, [s for s in (gather_shards(snap) if stage == 0 else snap) if s.layer in chosen])
    mixed = shard_values(snapshot_layers(te.layout, layers, pool))
    out["mixed"] = {name: same(mixed[name], snap_values[name] if name in chosen else current_values[name]) for name in layers}
    out["mixed_differs_from_current"] = {name: not same(mixed[name], current_values[name]) for name in chosen}
    out["pool_allocated_bytes"] = pool.allocated_bytes
    out["needed_covers_layer"] = {name: sum(s.length for s in needed_slices(te.layout, name)) for name in layers}
    shutdown(te)
    return out
