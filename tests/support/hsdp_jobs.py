"""Per-rank job of the HSDP test (spawned by tests/support/dist_harness.py on 4 gloo ranks).

The tiny Llama under ``fully_shard`` over HSDP's 2 x 2 replicate x shard mesh, torch's AdamW,
attached as a user's loop attaches it. Every layer is persisted at step ``S`` (each rank writing its
replica's run of its shard); at step ``T`` rank ``LOST`` is taken as lost: the three survivors hand
over their captures (each its whole shard). Recovery at ``t_fail = T`` must then give the state at
``T`` bit for bit, the lost rank's elements from its live twin, and the next step's loss again."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch

from layercheck.orchestrator.core.recovery.composite import load_composite
from layercheck.orchestrator.store.layer_store import LayerStore
from layercheck.orchestrator.store.recovery_source import resolve_plan
from layercheck.workers.attached import attach_engine
from layercheck.workers.capture import capture_shards
from layercheck.workers.host_buffers import HostBufferPool
from layercheck.workers.layer_state import optimizer_step_of, snapshot_layers
from tests.support.fsdp2_jobs import full_state, train_step
from tests.support.models import TINY_LLAMA

S, T, LOST = 2, 4, 1


def hsdp_llama(replicas: int, shards: int) -> tuple[torch.nn.Module, torch.optim.AdamW]:
    import transformers
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(7)
    config = transformers.LlamaConfig(**{k: v for k, v in TINY_LLAMA.items() if k != "model_type"})
    model = transformers.LlamaForCausalLM(config)
    mesh = init_device_mesh("cpu", (replicas, shards), mesh_dim_names=("replicate", "shard"))
    for block in model.model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    decay = [p for p in model.parameters() if p.ndim >= 2]
    rest = [p for p in model.parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}])
    return model, optimizer


def _write(store: LayerStore, shards: list[Any], *, capture: bool) -> None:
    """This rank's ``shards`` (``[]``: it hands nothing over) written; rank 0 commits each layer's."""
    receipts = [store.write_shard(s, base=not capture, origin="capture" if capture else "policy") for s in shards]
    everyone: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(everyone, receipts)
    if torch.distributed.get_rank() == 0:
        for i in range(len(everyone[0])):
            store.commit([r[i] for r in everyone if r], partial=capture)
    torch.distributed.barrier()


def hsdp_recovery_job(rank: int, world_size: int, store_uri: str) -> dict[str, Any]:
    model, optimizer = hsdp_llama(2, world_size // 2)
    attached = attach_engine(model, optimizer)
    layout, names = attached.layout, list(attached.layer_map.names)
    store, pool = LayerStore.open(store_uri, fsync=False), HostBufferPool()
    owned = {n: [(p.slice.name, p.slice.offset, p.slice.length) for p in layout[n].owned] for n in names}
    needed = {n: [(p.slice.name, p.slice.offset, p.slice.length) for p in layout[n].needed] for n in names}
    losses, drift = {}, {}
    for t in range(1, T + 2):
        losses[t] = train_step(model, optimizer, t, rank)
        drift[t] = attached.probe.collect(t).l1
        if t == S:
            _write(store, snapshot_layers(layout, names, pool), capture=False)
        if t == T:
            _write(store, capture_shards(layout, T, pool) if rank != LOST else [], capture=True)
            at_t = full_state(model, optimizer)
    # every rank now stands at T + 1: the composite at T must bring back T's state, all of it
    resolved = resolve_plan(store, attached.layer_map.numel, T)
    load_composite(
        SimpleNamespace(layer_map=layout.layer_map, layout=layout), store, resolved.records, overlays=resolved.overlays
    )
    got = full_state(model, optimizer)
    adam_steps = sorted({optimizer_step_of(layout, n) for n in names})
    attached.adapter.seek(T)
    again = train_step(model, optimizer, T + 1, rank)
    return {
        "owned": owned,
        "subgroups": layout.subgroups,
        "needed": needed,
        "drift": drift,
        "mismatches": sorted(k for k in at_t if not torch.equal(got[k], at_t[k])),
        "adam_steps": adam_steps,
        "max_staleness": resolved.plan.max_staleness,
        "next_loss": (losses[T + 1], again),
        "mesh": [int(m) for m in model.model.embed_tokens.weight.device_mesh.mesh.flatten()],
    }
