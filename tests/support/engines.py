"""The tests' one engine builder (a real DeepSpeed :class:`TrainEngine` on the tiny Llama) and what
the per-rank jobs do with an engine: deterministic batches, the full fp32 state through DeepSpeed's
public helpers (an independent reference for the layout code), shard values to compare."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from layercheck.workers.config import EngineConfig, ModelConfig, OptimConfig
from layercheck.workers.engine import TrainEngine, build_engine
from layercheck.workers.shard import STATE_KEYS, LayerShard
from tests.support.models import SEQ, TINY_LLAMA

#: The optimizer the tests train with unless they say otherwise (cosine schedule).
OPTIM: dict[str, Any] = {"lr": 3e-3, "weight_decay": 0.1, "warmup_steps": 2, "total_steps": 20, "min_lr_ratio": 0.1}


def engine_configs(
    stage: int = 0,
    precision: str = "fp32",
    *,
    hf_config: dict[str, Any] = TINY_LLAMA,
    seed: int = 7,
    freeze: tuple[str, ...] = (),
    micro_batch: int = 2,
    grad_accum: int = 1,
    grad_clip: float = 1.0,
    **optim: Any,
) -> tuple[ModelConfig, OptimConfig, EngineConfig]:
    """The model, optimizer and engine configs of :func:`make_engine` (``optim``: fields of
    :class:`OptimConfig` over :data:`OPTIM`)."""
    return (
        ModelConfig(hf_config=hf_config, seed=seed, freeze=freeze),
        OptimConfig(**{**OPTIM, **optim}),
        EngineConfig(
            zero_stage=stage, precision=precision, micro_batch=micro_batch, grad_accum=grad_accum, grad_clip=grad_clip
        ),
    )


def make_engine(stage: int = 0, precision: str = "fp32", **options: Any) -> TrainEngine:
    """A DeepSpeed engine on this rank (joins the process group): see :func:`engine_configs`."""
    return build_engine(*engine_configs(stage, precision, **options))


def token_batch(
    step: int, rank: int, *, micro: int = 0, rows: int = 2, vocab: int = TINY_LLAMA["vocab_size"]
) -> torch.Tensor:
    """Token ids a pure function of (step, micro-batch, rank)."""
    g = torch.Generator().manual_seed(100_000 * step + 100 * micro + rank)
    return torch.randint(0, vocab, (rows, SEQ), generator=g)


def batches(train_engine: TrainEngine, step: int, rank: int) -> list[torch.Tensor]:
    """The micro-batches rank ``rank`` trains on at ``step`` (a pure function of both)."""
    rows, vocab = train_engine.engine_cfg.micro_batch, train_engine.model_cfg.hf_config["vocab_size"]
    return [
        token_batch(step, rank, micro=micro, rows=rows, vocab=vocab)
        for micro in range(train_engine.engine_cfg.grad_accum)
    ]


def probe_batch() -> torch.Tensor:
    """The batch the tests evaluate losses on (never trained on)."""
    g = torch.Generator().manual_seed(424242)
    return torch.randint(0, TINY_LLAMA["vocab_size"], (2, SEQ), generator=g)


def full_fp32(train_engine: TrainEngine, name: str) -> torch.Tensor:
    """The whole fp32 master of parameter ``name``, through DeepSpeed's public helpers where
    they exist (collective at ZeRO-3): an independent reference for the layout code."""
    import deepspeed

    from layercheck.workers.engines import ds_internals

    param = dict(train_engine.engine.module.named_parameters())[name]
    if train_engine.engine_cfg.zero_stage == 0:
        master = {id(lp): hp for lp, hp in ds_internals.zero0_master_pairs(train_engine.engine)}[id(param)]
        return master.detach().clone().float().view(-1)
    return deepspeed.utils.safe_get_full_fp32_param(param).detach().clone().float().view(-1)


def all_full_fp32(train_engine: TrainEngine) -> dict[str, torch.Tensor]:
    return {p.name: full_fp32(train_engine, p.name) for layer in train_engine.layer_map.layers for p in layer.params}


def full_state(train_engine: TrainEngine, layers: Sequence[str]) -> dict[str, torch.Tensor]:
    """``{"<key>/<param>": flat tensor}`` for every parameter of ``layers`` (collective at ZeRO-3)."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    params = dict(train_engine.engine.module.named_parameters())
    out = {}
    for layer in layers:
        for info in train_engine.layer_map[layer].params:
            p = params[info.name]
            out[f"fp32/{info.name}"] = safe_get_full_fp32_param(p)
            for key in ("exp_avg", "exp_avg_sq"):
                out[f"{key}/{info.name}"] = safe_get_full_optimizer_state(p, key)
    return {k: v.detach().float().reshape(-1).clone() for k, v in out.items()}


def shard_values(shards: list[LayerShard]) -> dict[str, Any]:
    return {s.layer: {k: s.tensors[k].clone() for k in STATE_KEYS} | {"step": s.optimizer_step} for s in shards}


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return all(torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a)


def gather_shards(shards: list[LayerShard]) -> list[LayerShard]:
    """Every rank's shards (ZeRO-0 restore needs whole parameters); in-memory test transport."""
    everyone: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(everyone, shards)
    return [s for rank_shards in everyone for s in rank_shards]
