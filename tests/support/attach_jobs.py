"""Per-rank jobs for the attach tests: a user's own DeepSpeed engine (own optimizer, param groups
that do not follow layers, own DeepSpeed config) with LayerCheck attached, no Ray.
Spawned by tests/support/dist_harness.py; must be importable."""

from __future__ import annotations

import hashlib
from typing import Any

import torch

from layercheck.workers import env
from layercheck.workers.attached import AttachedEngine, attach_engine
from layercheck.workers.drift.probe import global_drift
from layercheck.workers.host_buffers import HostBufferPool
from layercheck.workers.layer_state import restore_from_shards, snapshot_layers
from tests.support.engines import gather_shards, same, shard_values, token_batch
from tests.support.models import TINY_LLAMA

LR = 3e-3


def _model() -> torch.nn.Module:
    import transformers

    torch.manual_seed(7)
    hf = dict(TINY_LLAMA)
    config = transformers.AutoConfig.for_model(hf.pop("model_type"), **hf)
    return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def user_engine(stage: int, optimizer: str) -> Any:
    """An engine as a user builds it: their optimizer and groups, their DeepSpeed config dict."""
    env.init_distributed()
    import deepspeed

    model = _model()
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": stage},
        "steps_per_print": 10**9,
    }
    client = None
    if optimizer == "ds_config":  # the DeepSpeed config names the optimizer and the schedule
        config["optimizer"] = {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.1, "torch_adam": True}}
        config["scheduler"] = {
            "type": "WarmupDecayLR",
            "params": {"warmup_min_lr": 0, "warmup_max_lr": LR, "warmup_num_steps": 2, "total_num_steps": 20},
        }
    elif optimizer == "decay_groups":  # the usual decay / no-decay split, across all layers
        decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
        no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
        client = torch.optim.AdamW(
            [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}], lr=LR
        )
    elif optimizer == "sgd":
        client = torch.optim.SGD(model.parameters(), lr=LR)
    else:
        raise ValueError(optimizer)
    scheduler = None
    if client is not None:
        config["zero_allow_untested_optimizer"] = True
        scheduler = torch.optim.lr_scheduler.LambdaLR(client, lambda s: min(1.0, (s + 1) / 2) * 0.97**s)
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        optimizer=client,
        lr_scheduler=scheduler,
        config=config,
        model_parameters=model.parameters() if client is None else None,
    )
    return engine


def _step(engine: Any, step: int, rank: int) -> float:
    ids = token_batch(step, rank)
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    engine.step()
    return float(loss.detach())


def _full(att: AttachedEngine, name: str, stage: int) -> torch.Tensor:
    import deepspeed

    from layercheck.workers.engines import ds_internals

    param = dict(att.engine.module.named_parameters())[name]
    if stage == 0:
        master = {id(lp): hp for lp, hp in ds_internals.zero0_master_pairs(att.engine)}[id(param)]
        return master.detach().clone().float().view(-1)
    return deepspeed.utils.safe_get_full_fp32_param(param).detach().clone().float().view(-1)


def user_engine_job(rank: int, world_size: int, stage: int, optimizer: str, probe: str = "auto") -> dict[str, Any]:
    """The probe's drift against full-parameter diffs; snapshot → train → restore → train again
    reproduces the losses and the state, with the user's optimizer, groups and schedule."""
    engine = user_engine(stage, optimizer)
    att = attach_engine(engine, drift_probe=probe)
    layers = list(att.layer_map.names)
    params = {p.name for layer in att.layer_map.layers for p in layer.params}
    out: dict[str, Any] = {"groups": len(att.layout.optimizer.param_groups)}
    pairs = []
    for t in range(1, 4):
        before = {n: _full(att, n, stage) for n in sorted(params)}
        _step(engine, t, rank)
        local = att.probe.collect(t)
        out["probe"] = local.cost.probe if local.cost else None
        drift = global_drift(local)
        after = {n: _full(att, n, stage) for n in sorted(params)}
        for layer in att.layer_map.layers:
            diff = sum(float((after[p.name] - before[p.name]).abs().double().sum()) for p in layer.params)
            pairs.append((layer.name, drift[layer.name], diff / layer.numel))
    out["drift"] = pairs
    pool = HostBufferPool()
    snap = snapshot_layers(att.layout, layers, pool)
    out["trained"] = _digest(shard_values(snap))  # each probe's run, bit for bit the user's step
    lr_at_snap = att.adapter.current_lr()
    first = [_step(engine, 4 + i, rank) for i in range(3)]
    end = shard_values(snapshot_layers(att.layout, layers, pool))
    restore_from_shards(att.layout, gather_shards(snap) if stage == 0 else snap)
    att.probe.reset()
    _rewind_scheduler(engine)  # as on a restarted worker: a fresh schedule, moved to the snapshot's step
    att.adapter.seek(3)
    out["lr"] = (lr_at_snap, att.adapter.current_lr())
    second = [_step(engine, 4 + i, rank) for i in range(3)]
    out["losses"] = (first, second)
    out["end_state_equal"] = all(
        same(v, end[name]) for name, v in shard_values(snapshot_layers(att.layout, layers, pool)).items()
    )
    return out


def _digest(values: dict[str, dict[str, Any]]) -> str:
    digest = hashlib.sha256()
    for layer in sorted(values):
        for _, value in sorted(values[layer].items()):
            digest.update(value.numpy().tobytes() if isinstance(value, torch.Tensor) else repr(value).encode())
    return digest.hexdigest()


def _rewind_scheduler(engine: Any) -> None:
    scheduler = engine.lr_scheduler
    if hasattr(scheduler, "last_batch_iteration"):
        scheduler.last_batch_iteration = -1
    else:
        scheduler.last_epoch = 0
        for group, base in zip(scheduler.optimizer.param_groups, scheduler.base_lrs):
            group["lr"] = base * scheduler.lr_lambdas[0](0)


class CustomLM(torch.nn.Module):
    """A model whose parameter names follow no known family."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = torch.nn.Linear(8, 8)
        self.dec = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dec(torch.relu(self.enc(x)))


def bad_input_job(rank: int, world_size: int) -> dict[str, Any]:
    """The errors a user meets before training: an unmappable model, an unsupported optimizer."""
    env.init_distributed()
    import deepspeed

    from layercheck.policies.layer_map import UnplacedParameterError
    from layercheck.workers.optim_state import UnsupportedOptimizerError

    out: dict[str, Any] = {}
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": 1},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
    }
    model = CustomLM()
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3), config=config
    )
    try:
        attach_engine(engine)
    except UnplacedParameterError as error:
        out["unplaced"] = str(error)
    att = attach_engine(engine, layer_map={"encoder": ["enc."], "decoder": ["dec."]})
    out["mapped"] = {layer.name: [p.name for p in layer.params] for layer in att.layer_map.layers}
    x = torch.randn(1, 8)
    engine.backward(engine(x).pow(2).sum())
    engine.step()
    out["drift_layers"] = sorted(att.probe.collect(1).l1)
    model = CustomLM()
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=torch.optim.SGD(model.parameters(), lr=1e-3), config=config
    )
    try:
        attach_engine(engine, layer_map=lambda name: name.split(".")[0])
    except UnsupportedOptimizerError as error:
        out["optimizer"] = str(error)
    return out


def recorded_model_job(rank: int, world_size: int, storage: str, heads: int, kv_heads: int) -> str:
    """``layercheck.attach`` of an engine with ``heads``/``kv_heads`` attention heads, in a run (no
    Ray: attach must raise before it looks for the run's actors) whose layer sizes match it; the
    error attach raised, as ``"Name: message"``, or ``"attached"``."""
    env.init_distributed()
    import deepspeed
    import transformers

    from layercheck.orchestrator.core.run_config import FaultConfig
    from layercheck.orchestrator.runtime.context import WorkerContext, call_with_context
    from layercheck.policies.layer_map import layer_map_of
    from layercheck.worker import attach

    hf = {**TINY_LLAMA, "num_attention_heads": heads, "num_key_value_heads": kv_heads}
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model(hf.pop("model_type"), **hf), dtype=torch.float32
    )
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 0}, "steps_per_print": 10**9}
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=LR), config=config
    )
    context = WorkerContext(
        run_id="recorded-model",
        storage_uri=storage,
        fsync=False,
        max_inflight_bytes=1 << 20,
        fault=FaultConfig(),
        drift_probe="snapshot_diff",
        layer_map=None,
        layer_numel=dict(layer_map_of(model).numel),  # the sizes agree: only the config tells them apart
    )
    try:
        call_with_context(lambda: attach(engine), context)
    except Exception as error:  # noqa: BLE001 - the test reads which error it was
        return f"{type(error).__name__}: {error}"
    return "attached"
