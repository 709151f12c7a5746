"""Per-rank job for the frozen-layer / layer-wise LR decay tests (spawned; must be importable)."""

from __future__ import annotations

from typing import Any

import torch

from layercheck.workers.config import ModelConfig
from layercheck.workers.engine import build_model, layer_map_for, seek_step, shutdown
from layercheck.workers.host_buffers import HostBufferPool
from layercheck.workers.layer_state import restore_from_shards, snapshot_layers
from layercheck.workers.lr_schedule import lr_at
from layercheck.workers.step import eval_loss, train_step
from tests.support.engines import batches, engine_configs, gather_shards, make_engine, probe_batch, same, shard_values
from tests.support.models import FOUR_BLOCKS, SEQ

FREEZE = ("embed", "block.[01]")
DECAY = 0.5
OPTIONS = {"hf_config": FOUR_BLOCKS, "freeze": FREEZE, "layer_lr_decay": DECAY}


def model_cfg() -> ModelConfig:
    return engine_configs(**OPTIONS)[0]


def module_weights(train_engine: Any) -> dict[str, torch.Tensor]:
    """Every module parameter as the forward sees it (gathered at ZeRO-3), on the host."""
    import deepspeed

    out = {}
    for name, param in train_engine.engine.module.named_parameters():
        with deepspeed.zero.GatheredParameters([param], enabled=train_engine.engine_cfg.zero_stage == 3):
            out[name] = param.detach().float().cpu().clone()
    return out


def frozen_job(rank: int, world_size: int, stage: int, ckpt_dir: str) -> dict[str, Any]:
    """Frozen layers are absent from the layer map, the groups and the layout; they never change
    and equal a fresh build; snapshot -> train -> restore still reproduces the trajectory; each
    group trains at its layer's decayed lr."""
    train_engine = make_engine(stage, **OPTIONS)
    frozen_names = [n for n, p in train_engine.engine.module.named_parameters() if not p.requires_grad]
    fresh = {n: p.detach().clone() for n, p in build_model(model_cfg()).named_parameters()}
    out: dict[str, Any] = {
        "layers": list(train_engine.layer_map.names),
        "meta_layers": list(layer_map_for(model_cfg()).names),
        "layout_layers": list(train_engine.layout.layers),
        "frozen_params": frozen_names,
        "groups": [g["name"] for g in train_engine.optimizer.param_groups],
    }
    before = module_weights(train_engine)
    pool = HostBufferPool()
    layers = list(train_engine.layer_map.names)
    for t in range(3):
        train_step(train_engine, batches(train_engine, t, rank))
    snap = snapshot_layers(train_engine.layout, layers, pool)
    snap_values = shard_values(snap)
    first = [train_step(train_engine, batches(train_engine, 3 + i, rank))[0] for i in range(3)]
    restore_from_shards(train_engine.layout, gather_shards(snap) if stage == 0 else snap)
    seek_step(train_engine, 3)
    out["restored_equals_snapshot"] = all(
        same(v, snap_values[n]) for n, v in shard_values(snapshot_layers(train_engine.layout, layers, pool)).items()
    )
    second = [train_step(train_engine, batches(train_engine, 3 + i, rank))[0] for i in range(3)]
    out["losses"] = (first, second)
    after = module_weights(train_engine)
    out["frozen_unchanged"] = all(torch.equal(before[n], after[n]) for n in frozen_names)
    out["frozen_equal_fresh_build"] = all(torch.equal(after[n], fresh[n]) for n in frozen_names)
    out["trained_changed"] = all(not torch.equal(before[n], after[n]) for n in before if n not in frozen_names)
    out["lr"] = {
        g["name"]: (g["lr"], lr_at(6, train_engine.optim_cfg) * g["lr_scale"], g["lr_scale"])
        for g in train_engine.optimizer.param_groups
    }
    out["probe_loss_finite"] = bool(torch.isfinite(torch.tensor(eval_loss(train_engine, probe_batch()))))
    # DeepSpeed's load_checkpoint replaces the client optimizer's group dicts: the layout
    # follows the live ones (snapshots name the right groups, restores set live hyper-parameters)
    train_engine.engine.save_checkpoint(ckpt_dir, tag="t")
    train_engine.engine.load_checkpoint(ckpt_dir, tag="t")
    shards = snapshot_layers(train_engine.layout, layers, pool)
    out["groups_follow_load_state_dict"] = all(
        g["index"] == i and train_engine.optimizer.param_groups[i]["name"] == g["name"]
        for s in shards
        for g in s.groups
        for i in [g["index"]]
    ) and all(
        a is b
        for n in layers
        for a, b in zip(
            train_engine.layout.groups_of(n),
            (train_engine.optimizer.param_groups[i] for i in train_engine.layout[n].group_indices),
        )
    )
    out["seq"] = SEQ
    shutdown(train_engine)
    return out
