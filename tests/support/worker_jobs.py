"""Per-rank jobs for the worker tests (spawned through tests/support/dist_harness.py; must be
importable).

Each job builds a real DeepSpeed engine on the tiny Llama (tests/support/engines.py) and checks
several properties in one process start, returning plain values for the test to assert on.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

import torch

from layercheck.workers.drift.diff import SnapshotDiffProbe
from layercheck.workers.drift.probe import global_drift
from layercheck.workers.engine import seek_step, shutdown
from layercheck.workers.host_buffers import HostBufferPool
from layercheck.workers.layer_state import needed_slices, restore_from_shards, snapshot_layers
from layercheck.workers.shard import STATE_KEYS, LayerShard
from layercheck.workers.step import eval_loss, train_step
from tests.support.engines import all_full_fp32, batches, gather_shards, make_engine, probe_batch, same, shard_values


def drift_and_roundtrip_job(rank: int, world_size: int, stage: int, precision: str, grad_accum: int) -> dict[str, Any]:
    """Drift vs snapshot-and-diff; snapshot → train → restore reproduces the trajectory;
    the forward reads restored weights; a partial restore touches only its layers."""
    train_engine = make_engine(stage, precision, grad_accum=grad_accum)
    pool = HostBufferPool()
    layers = list(train_engine.layer_map.names)
    out: dict[str, Any] = {
        "groups": [(g["name"], g["weight_decay"], g["lr"]) for g in train_engine.optimizer.param_groups]
    }
    out["numel"] = train_engine.probe.numel
    out["layer_numel"] = train_engine.layer_map.numel

    # 1. Drift: the probe against a local snapshot-and-diff and a global full-parameter diff.
    local_pairs, global_pairs = [], []
    k = 3
    for t in range(k):
        before_local = shard_values(snapshot_layers(train_engine.layout, layers, pool))
        before_full = all_full_fp32(train_engine)
        _, drift = train_step(train_engine, batches(train_engine, t, rank))
        after_local = shard_values(snapshot_layers(train_engine.layout, layers, pool))
        after_full = all_full_fp32(train_engine)
        for name in layers:
            ref = float((after_local[name]["fp32"] - before_local[name]["fp32"]).abs().double().sum())
            local_pairs.append((name, drift.l1[name], ref))
        reduced = global_drift(drift)
        for layer in train_engine.layer_map.layers:
            diff = sum(float((after_full[p.name] - before_full[p.name]).abs().double().sum()) for p in layer.params)
            global_pairs.append((layer.name, reduced[layer.name], diff / layer.numel))
    out["local_drift"], out["global_drift"] = local_pairs, global_pairs

    # 2. Round trip: snapshot at k, train n, restore, train the same n again.
    snap = snapshot_layers(train_engine.layout, layers, pool)
    snap_values = shard_values(snap)
    loss_at_snap = eval_loss(train_engine, probe_batch())
    n = 3
    first = [train_step(train_engine, batches(train_engine, k + i, rank)) for i in range(n)]
    current = snapshot_layers(train_engine.layout, layers, pool)
    current_values = shard_values(current)
    pool.release(current[0])  # exercise reuse: the next same-sized snapshot takes this buffer back
    restore_from_shards(train_engine.layout, gather_shards(snap) if stage == 0 else snap)
    seek_step(train_engine, k)
    out["loss_at_snapshot"] = (loss_at_snap, eval_loss(train_engine, probe_batch()))
    out["restored_equals_snapshot"] = all(
        same(v, snap_values[name])
        for name, v in shard_values(snapshot_layers(train_engine.layout, layers, pool)).items()
    )
    second = [train_step(train_engine, batches(train_engine, k + i, rank)) for i in range(n)]
    out["losses"] = ([loss for loss, _ in first], [loss for loss, _ in second])
    out["drifts"] = ([dict(d.l1) for _, d in first], [dict(d.l1) for _, d in second])
    out["end_state_equal"] = all(
        same(v, current_values[name])
        for name, v in shard_values(snapshot_layers(train_engine.layout, layers, pool)).items()
    )

    # 3. Mixed: restore only some layers from the older snapshot.
    chosen = [layers[0], layers[2]]
    restore_from_shards(
        train_engine.layout, [s for s in (gather_shards(snap) if stage == 0 else snap) if s.layer in chosen]
    )
    mixed = shard_values(snapshot_layers(train_engine.layout, layers, pool))
    out["mixed"] = {
        name: same(mixed[name], snap_values[name] if name in chosen else current_values[name]) for name in layers
    }
    out["mixed_differs_from_current"] = {name: not same(mixed[name], current_values[name]) for name in chosen}
    out["pool_allocated_bytes"] = pool.allocated_bytes
    out["needed_covers_layer"] = {
        name: sum(s.length for s in needed_slices(train_engine.layout, name)) for name in layers
    }

    # 4. Sampled drift (a policy's drift_every = 2): both probes measure the next step (armed by the
    # reset), then every second one, each exactly that step's update; the others report nothing.
    train_engine.probe.measure_every(2)
    diff_probe = SnapshotDiffProbe(train_engine.layout, every=2)
    sampled, costs = [], []
    for i in range(4):
        before = shard_values(snapshot_layers(train_engine.layout, layers, pool))
        _, drift = train_step(train_engine, batches(train_engine, 10 + i, rank))
        diffed = diff_probe.collect(train_engine.step)
        after = shard_values(snapshot_layers(train_engine.layout, layers, pool))
        reference = {n: float((after[n]["fp32"] - before[n]["fp32"]).abs().double().sum()) for n in layers}
        sampled.append((train_engine.step, drift.measured, dict(drift.l1), diffed.measured, dict(diffed.l1), reference))
        costs.append((asdict(drift.cost), asdict(diffed.cost)))
    out["sampled"] = sampled
    out["probe_costs"] = costs
    shutdown(train_engine)
    return out


def internals_job(rank: int, world_size: int, stage: int, precision: str) -> dict[str, Any]:
    """Each ds_internals wrapper against DeepSpeed's public helpers or the model itself."""
    import deepspeed

    from layercheck.workers.drift.adamw import DriftAdamW
    from layercheck.workers.engines import ds_internals

    train_engine = make_engine(stage, precision)
    train_step(train_engine, batches(train_engine, 0, rank))
    engine, out = train_engine.engine, {}
    out["client_is_drift_adamw"] = isinstance(ds_internals.client_optimizer(engine), DriftAdamW)
    params = dict(engine.module.named_parameters())
    names = [p.name for layer in train_engine.layer_map.layers for p in layer.params]
    target = names[1]  # a block matrix
    if stage == 0:
        pairs = ds_internals.zero0_master_pairs(engine)
        out["pairs_cover_params"] = sorted(id(lp) for lp, _ in pairs) == sorted(id(p) for p in params.values())
        out["masters_match_model"] = all(torch.equal(hp.to(lp.dtype), lp) for lp, hp in pairs)
        out["masters_are_fp32"] = all(hp.dtype == torch.float32 for _, hp in pairs)
        hp = {id(lp): hp for lp, hp in pairs}[id(params[target])]
        with torch.no_grad():
            hp.add_(1.0)
        ds_internals.zero0_refresh_lp(pairs)
        out["refresh_reaches_model"] = torch.equal(params[target].detach(), hp.detach().to(params[target].dtype))
    else:
        coverage, values_ok = {}, True
        flats = (ds_internals.zero12_flat_partitions if stage in (1, 2) else ds_internals.zero3_flat_partitions)(
            engine.optimizer
        )
        for name in names:
            p = params[name]
            frag = (
                ds_internals.zero12_fragment(p) if stage in (1, 2) else ds_internals.zero3_fragment(engine.optimizer, p)
            )
            full = deepspeed.utils.safe_get_full_fp32_param(p).detach().view(-1)
            if frag is None or frag.length == 0:
                coverage[name] = 0
                continue
            mine = flats[frag.flat_index].narrow(0, frag.flat_start, frag.length)
            values_ok &= torch.equal(mine, full[frag.param_offset : frag.param_offset + frag.length])
            coverage[name] = frag.length
        out["coverage"] = coverage
        out["numel"] = {n: int(params[n].ds_numel if stage == 3 else params[n].numel()) for n in names}
        out["fragment_values_match_public_helper"] = bool(values_ok)
        if stage == 3:
            groups = ds_internals.zero3_sub_group_to_group(engine.optimizer)
            out["sub_groups_cover_groups"] = sorted(set(groups.values())) == list(
                range(len(train_engine.optimizer.param_groups))
            )
        frag = (
            ds_internals.zero12_fragment(params[target])
            if stage in (1, 2)
            else ds_internals.zero3_fragment(engine.optimizer, params[target])
        )
        with torch.no_grad():
            if frag is not None and frag.length:
                flats[frag.flat_index].narrow(0, frag.flat_start, frag.length).add_(1.0)
            expected = deepspeed.utils.safe_get_full_fp32_param(params[target]).detach().clone()
        (ds_internals.zero12_refresh_lp if stage in (1, 2) else ds_internals.zero3_refresh_lp)(engine.optimizer)
        with deepspeed.zero.GatheredParameters([params[target]]):
            seen = params[target].detach().float().clone()
        out["refresh_reaches_model"] = torch.allclose(seen, expected.to(params[target].dtype).float())
    shutdown(train_engine)
    return out


def save_snapshot_job(rank: int, world_size: int, stage: int, out_dir: str) -> dict[str, Any]:
    """Train two steps, write every layer's shard (safetensors + JSON), report the probe loss."""
    import json
    from pathlib import Path

    from safetensors.torch import save_file

    train_engine = make_engine(stage, "fp32")
    for t in range(2):
        train_step(train_engine, batches(train_engine, t, rank))
    for shard in snapshot_layers(train_engine.layout, list(train_engine.layer_map.names), HostBufferPool()):
        stem = Path(out_dir, f"{shard.layer}.rank{rank}")
        save_file({k: v.contiguous() for k, v in shard.tensors.items()}, f"{stem}.safetensors")
        meta = {
            "layer": shard.layer,
            "step": shard.step,
            "rank": rank,
            "world_size": world_size,
            "optimizer_step": shard.optimizer_step,
            "groups": list(shard.groups),
            "slices": [[s.name, list(s.shape), s.offset, s.length] for s in shard.slices],
        }
        Path(f"{stem}.json").write_text(json.dumps(meta))
    loss = eval_loss(train_engine, probe_batch())
    shutdown(train_engine)
    return {"loss": loss}


def load_snapshot_job(rank: int, world_size: int, stage: int, in_dir: str) -> dict[str, Any]:
    """Restore a fresh engine from shards written at another world size / stage, through a
    range reader over the files; report the probe loss and whether state equals the files'."""
    import json
    from pathlib import Path

    from safetensors.torch import load_file

    from layercheck.workers.layer_state import ShardReader, metas_of, restore_layers
    from layercheck.workers.shard import ParamSlice

    train_engine = make_engine(stage, "fp32")
    shards = []
    for meta_path in sorted(Path(in_dir).glob("*.json")):
        meta = json.loads(meta_path.read_text())
        tensors = load_file(str(meta_path.with_suffix(".safetensors")))
        slices = tuple(ParamSlice(n, tuple(shape), o, length) for n, shape, o, length in meta["slices"])
        shards.append(
            LayerShard(
                layer=meta["layer"],
                step=meta["step"],
                rank=meta["rank"],
                world_size=meta["world_size"],
                slices=slices,
                tensors=tensors,
                optimizer_step=meta["optimizer_step"],
                groups=tuple(meta["groups"]),
            )
        )
    reader = ShardReader(shards)
    requested: list[tuple[str, str, int, int]] = []

    def read(name: str, key: str, offset: int, length: int) -> torch.Tensor:
        requested.append((name, key, offset, length))
        return reader(name, key, offset, length)

    restore_layers(train_engine.layout, metas_of(shards), read)
    seek_step(train_engine, shards[0].step)
    needed = {
        (s.name, s.offset, s.length)
        for layer in train_engine.layer_map.names
        for s in needed_slices(train_engine.layout, layer)
    }
    state_ok = True
    for shard in snapshot_layers(train_engine.layout, list(train_engine.layer_map.names), HostBufferPool()):
        for i, s in enumerate(shard.slices):
            for key in STATE_KEYS:
                state_ok &= torch.equal(shard.view(key, i), reader(s.name, key, s.offset, s.length))
        state_ok &= shard.optimizer_step == shards[0].optimizer_step
    out = {
        "loss": eval_loss(train_engine, probe_batch()),
        "state_equals_files": bool(state_ok),
        "read_only_needed": {(n, o, length) for n, _, o, length in requested} == needed,
        "step": train_engine.step,
    }
    train_step(train_engine, batches(train_engine, 2, rank))  # and training carries on from the restored state
    shutdown(train_engine)
    return out


def fused_drift_job(rank: int, world_size: int, stage: int, precision: str) -> dict[str, Any]:
    """The fused step's per-layer drift next to snapshot-and-diff over the same layout, per step."""
    from layercheck.workers.drift.diff import SnapshotDiffProbe

    train_engine = make_engine(stage, precision, drift_step="fused")
    reference = SnapshotDiffProbe(train_engine.layout)
    pairs, losses = [], []
    for t in range(4):
        loss, drift = train_step(train_engine, batches(train_engine, t, rank))
        expected = reference.collect(t + 1)
        pairs.extend((t, name, drift.l1[name], expected.l1[name]) for name in train_engine.layer_map.names)
        losses.append(loss)
    out = {"pairs": pairs, "losses": losses, "drift_step": train_engine.optimizer.drift_step}
    shutdown(train_engine)
    return out


def snapshot_copy_job(rank: int, world_size: int) -> dict[str, Any]:
    """Snapshot every layer at step 2 through the copier, train step 3 at once, then hand over:
    the handed shards must equal a joined snapshot taken at step 2."""
    from layercheck.workers.snapshot_copy import Handover, copier_for

    precision = "bf16" if torch.cuda.is_available() else "fp32"
    train_engine = make_engine(0, precision)
    layers = list(train_engine.layer_map.names)
    for t in range(2):
        train_step(train_engine, batches(train_engine, t, rank))
    reference = shard_values(snapshot_layers(train_engine.layout, layers, HostBufferPool()))
    handed: list[LayerShard] = []
    copier = copier_for(train_engine.layout)
    pool = HostBufferPool()
    handover = Handover(copier, lambda shards, base: handed.extend(shard_values(shards).items()), pool)
    handover.take(layers, 2, base=False)
    handed_before_next_step = bool(handed)
    train_step(train_engine, batches(train_engine, 2, rank))
    handover.flush(wait=True)
    copier.close()
    after = shard_values(snapshot_layers(train_engine.layout, layers, HostBufferPool()))
    got = dict(handed)
    out = {
        "copier": type(copier).__name__,
        "handed_before_next_step": handed_before_next_step,
        "layers": layers,
        "equal": {name: name in got and same(got[name], reference[name]) for name in layers},
        "changed_after": any(not torch.equal(after[n]["fp32"], reference[n]["fp32"]) for n in layers),
    }
    shutdown(train_engine)
    return out
