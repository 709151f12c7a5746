"""Per-rank jobs for the composite and export tests (spawned by tests/support/dist_harness.py).

A tiny Llama with tied embeddings trains at ZeRO-3 and writes versions of its layers to a real
:class:`LayerStore` at a mix of steps (a base, then some layers newer than others). Beside each
version, rank 0 writes the layer's full fp32 weights and Adam moments gathered with DeepSpeed's
public ``safe_get_full_*`` helpers: the expected values, independent of the store's code.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from layercheck.orchestrator.core.run_config import ClusterConfig, RunConfig
from layercheck.orchestrator.store.layer_store import LayerStore
from layercheck.workers.engine import TrainEngine, build_engine, build_model, seek_step, shutdown
from layercheck.workers.host_buffers import HostBufferPool
from layercheck.workers.layer_state import optimizer_step_of, snapshot_layers
from layercheck.workers.step import eval_loss, train_step
from tests.support.engines import batches, engine_configs, full_state, probe_batch
from tests.support.models import TIED_LLAMA

ALL = ("embed", "block.0", "block.1", "norm")
#: step → (layers persisted after it, base?). Composite at 6: embed@6, block.0@4, block.1@5, norm@5.
SCHEDULE: dict[int, tuple[tuple[str, ...], bool]] = {
    2: (ALL, True),
    4: (("embed", "block.0"), False),
    5: (("block.1", "norm"), False),
    6: (("embed",), False),
}
STEPS = 6


def run_config(zero_stage: int = 3, num_workers: int = 2) -> RunConfig:
    model, optim, engine = engine_configs(zero_stage, hf_config=TIED_LLAMA)
    return RunConfig(
        name="composite-test",
        steps=20,
        model=model,
        optim=optim,
        engine=engine,
        cluster=ClusterConfig(num_workers=num_workers),
    )


def write_run_json(store_uri: str, config: RunConfig) -> None:
    from layercheck.orchestrator.store.layer_store import RUN_CONFIG_FILE

    LayerStore.open(store_uri, fsync=False).fs.write_bytes(RUN_CONFIG_FILE, json.dumps(config.to_json()).encode())


def make_engine(config: RunConfig) -> TrainEngine:
    """The engine of ``config`` (:func:`tests.support.engines.make_engine`'s, with tied embeddings)."""
    return build_engine(config.model, config.optim, config.engine)


def expected_file(expect_dir: str | Path, layer: str, step: int) -> Path:
    return Path(expect_dir, f"{layer}@{step}.safetensors")


def _persist(
    train_engine: TrainEngine,
    store: LayerStore,
    layers: Sequence[str],
    base: bool,
    pool: HostBufferPool,
    expect_dir: str,
    rank: int,
) -> None:
    shards = snapshot_layers(train_engine.layout, list(layers), pool)
    receipts = [store.write_shard(s, base=base) for s in shards]
    for shard in shards:
        pool.release(shard)
    everyone: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(everyone, receipts)
    expected = {layer: full_state(train_engine, [layer]) for layer in layers}
    if rank == 0:
        from safetensors.torch import save_file

        for i, layer in enumerate(layers):
            store.commit([r[i] for r in everyone])
            save_file(expected[layer], str(expected_file(expect_dir, layer, train_engine.step)))
    torch.distributed.barrier()


def train_and_store_job(rank: int, world_size: int, store_uri: str, expect_dir: str) -> dict[str, Any]:
    """Train ``STEPS`` steps at ZeRO-3, persisting per ``SCHEDULE``; the training losses and the
    probe loss at each persisting step."""
    train_engine = make_engine(run_config())
    store = LayerStore.open(store_uri, fsync=False)
    pool = HostBufferPool()
    losses, probe_loss = [], {}
    for t in range(1, STEPS + 1):
        losses.append(train_step(train_engine, batches(train_engine, t, rank))[0])
        if t in SCHEDULE:
            layers, base = SCHEDULE[t]
            _persist(train_engine, store, layers, base, pool, expect_dir, rank)
            probe_loss[t] = eval_loss(train_engine, probe_batch())
    shutdown(train_engine)
    return {"losses": losses, "probe_loss": probe_loss}


def composite_versions(t: int) -> dict[str, int]:
    """The step of each layer's version in the composite at ``t`` (from ``SCHEDULE``)."""
    return {layer: max(s for s, (layers, _) in SCHEDULE.items() if s <= t and layer in layers) for layer in ALL}


def expected_state(expect_dir: str, t: int) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for layer, step in composite_versions(t).items():
        out.update(load_file(str(expected_file(expect_dir, layer, step))))
    return out


def reference_model(config: RunConfig, expected: Mapping[str, torch.Tensor]) -> torch.nn.Module:
    """A plain host model whose weights are ``expected``'s fp32 values."""
    model = build_model(config.model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(expected[f"fp32/{name}"].view(p.shape))
    return model.eval()


def compare_state(train_engine: TrainEngine, expected: Mapping[str, torch.Tensor]) -> list[str]:
    """Names of the ``key/param`` tensors of the engine that differ from ``expected`` (collective)."""
    got = full_state(train_engine, list(train_engine.layer_map.names))
    return sorted(k for k in expected if not torch.equal(got[k], expected[k])) + sorted(set(got) - set(expected))


def adam_steps(train_engine: TrainEngine) -> dict[str, int]:
    return {layer: optimizer_step_of(train_engine.layout, layer) for layer in train_engine.layer_map.names}


def load_composite_job(rank: int, world_size: int, store_uri: str, t: int, expect_dir: str) -> dict[str, Any]:
    """A fresh ZeRO-3 engine at this world size loads the composite at ``t`` from the store:
    its state against the expected values, the probe loss, and two more training steps."""
    from layercheck.orchestrator.core.recovery.composite import load_composite
    from layercheck.orchestrator.store.recovery_source import resolve_plan

    train_engine = make_engine(run_config())
    store = LayerStore.open(store_uri, fsync=False)
    resolved = resolve_plan(store, train_engine.layer_map.numel, t)
    load_composite(train_engine, store, resolved.records)
    seek_step(train_engine, t)
    out: dict[str, Any] = {
        "versions": {layer: r.step for layer, r in resolved.records.items()},
        "mismatches": compare_state(train_engine, expected_state(expect_dir, t)),
        "adam_steps": adam_steps(train_engine),
        "loss": eval_loss(train_engine, probe_batch()),
        "lr": train_engine.engine.lr_scheduler.get_last_lr()[0],
    }
    out["train_losses"] = [train_step(train_engine, batches(train_engine, t + 1 + i, rank))[0] for i in range(2)]
    out["step"] = train_engine.step
    out["mismatches_after_training"] = len(compare_state(train_engine, expected_state(expect_dir, t)))
    shutdown(train_engine)
    return out


def check_export_job(
    rank: int, world_size: int, ds_dir: str, store_uri: str, t: int, expect_dir: str
) -> dict[str, Any]:
    """Resume from the exported DeepSpeed checkpoint with ``load_checkpoint`` and train; then put
    the composite in place in the same engine (``load_composite`` + ``seek_step``) and train the
    same steps again. Both runs, and the state ``load_checkpoint`` gave."""
    from layercheck.orchestrator.core.recovery.composite import load_composite
    from layercheck.orchestrator.store.recovery_source import resolve_plan

    train_engine = make_engine(run_config())
    load_path, client_state = train_engine.engine.load_checkpoint(ds_dir)
    out: dict[str, Any] = {
        "load_path": load_path,
        "client_state": client_state.get("layercheck_export"),
        "mismatches": compare_state(train_engine, expected_state(expect_dir, t)),
        "adam_steps": adam_steps(train_engine),
    }
    out["checkpoint"] = _continue(train_engine, t, rank)
    store = LayerStore.open(store_uri, fsync=False)
    load_composite(train_engine, store, resolve_plan(store, train_engine.layer_map.numel, t).records)
    seek_step(train_engine, t)
    out["in_place"] = _continue(train_engine, t, rank)
    shutdown(train_engine)
    return out


def _continue(train_engine: TrainEngine, t: int, rank: int) -> dict[str, Any]:
    return {
        "step": train_engine.step,
        "lr": train_engine.engine.lr_scheduler.get_last_lr()[0],
        "group_lrs": [g["lr"] for g in train_engine.optimizer.param_groups],
        "loss": eval_loss(train_engine, probe_batch()),
        "train_losses": [train_step(train_engine, batches(train_engine, t + 1 + i, rank))[0] for i in range(3)],
    }
