"""Per-rank jobs for the FSDP2 layout tests (spawned by tests/support/dist_harness.py): the tiny
Llama sharded with ``fully_shard`` (each decoder layer, then the root) over a 1-D CPU mesh on
gloo, trained with torch's AdamW in two param groups, its layers written to a real
:class:`LayerStore` and loaded back through the composite reader. Beside the store, rank 0 writes
every parameter's full fp32 weights and moments gathered with DTensor's ``full_tensor()``: the
expected values, independent of the layout code. No DeepSpeed is imported."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from layercheck.orchestrator.core.recovery.composite import load_composite
from layercheck.orchestrator.store.layer_store import LayerStore
from layercheck.orchestrator.store.recovery_source import resolve_plan
from layercheck.policies.layer_map import layer_map_from, model_layer_map
from layercheck.workers.engines.fsdp2 import build_fsdp2_layout
from layercheck.workers.host_buffers import HostBufferPool
from layercheck.workers.layer_state import optimizer_step_of, snapshot_layers
from layercheck.workers.layout import StateLayout
from layercheck.workers.shard import STATE_KEYS, LayerShard
from tests.support.models import SEQ, TINY_LLAMA

#: The step every layer is snapshotted and stored at; the run trains on to ``SAVED + 2``.
SAVED = 3
EXPECTED = "expected.safetensors"


def sharded_llama(world_size: int, *, fused: bool = False) -> tuple[torch.nn.Module, torch.optim.AdamW]:
    """The tiny Llama (same seed on every rank) under ``fully_shard`` over a 1-D mesh of
    ``world_size`` CPU ranks, and AdamW over a decay and a no-decay group."""
    model = sharded_model(world_size)
    decay = [p for _, p in model.named_parameters() if p.ndim >= 2]
    rest = [p for _, p in model.named_parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": 0.1, "name": "decay"},
            {"params": rest, "weight_decay": 0.0, "name": "rest"},
        ],
        lr=3e-3,
        foreach=not fused,
        fused=fused,
    )
    return model, optimizer


def sharded_model(world_size: int, **config: Any) -> torch.nn.Module:
    """The tiny Llama (``config`` overriding some of its sizes; same seed on every rank) under
    ``fully_shard``, each decoder layer then the root, over a 1-D mesh of ``world_size`` CPU ranks."""
    import transformers
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(7)
    sizes = {k: v for k, v in TINY_LLAMA.items() if k != "model_type"}
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**sizes, **config}))
    mesh = init_device_mesh("cpu", (world_size,))
    for block in model.model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def batch(step: int, rank: int) -> torch.Tensor:
    """Token ids a pure function of (step, rank)."""
    g = torch.Generator().manual_seed(100_000 * step + rank)
    return torch.randint(0, TINY_LLAMA["vocab_size"], (2, SEQ), generator=g)


def train_step(model: torch.nn.Module, optimizer: Any, step: int, rank: int) -> float:
    ids = batch(step, rank)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(loss)


def probe_loss(model: torch.nn.Module) -> float:
    """The loss on a batch never trained on (a forward only: FSDP2's root keeps its gathered
    parameters after it, which a restore must drop)."""
    ids = torch.randint(0, TINY_LLAMA["vocab_size"], (2, SEQ), generator=torch.Generator().manual_seed(424242))
    with torch.no_grad():
        return float(model(input_ids=ids, labels=ids).loss)


def full_state(model: torch.nn.Module, optimizer: Any) -> dict[str, torch.Tensor]:
    """``{"<key>/<param>": flat tensor}``, gathered with ``full_tensor()`` (collective)."""
    out = {}
    for name, param in model.named_parameters():
        out[f"fp32/{name}"] = param.full_tensor()
        for key in ("exp_avg", "exp_avg_sq"):
            out[f"{key}/{name}"] = optimizer.state[param][key].full_tensor()
    return {k: v.detach().reshape(-1).clone() for k, v in out.items()}


def _values(shards: list[LayerShard]) -> dict[str, Any]:
    return {s.layer: ({k: s.tensors[k].clone() for k in STATE_KEYS}, s.optimizer_step) for s in shards}


def _same(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """The layers/keys where ``a`` and ``b`` (from :func:`_values`) differ bit for bit."""
    odd = [f"{layer}: adam step {a[layer][1]} != {b[layer][1]}" for layer in a if a[layer][1] != b[layer][1]]
    return odd + [
        f"{layer}/{key}" for layer in a for key in STATE_KEYS if not torch.equal(a[layer][0][key], b[layer][0][key])
    ]


def _store_all(layout: StateLayout, store: LayerStore, step: int) -> dict[str, Any]:
    """Snapshot every layer at ``step``, write this rank's shards, rank 0 commits each version."""
    pool = HostBufferPool()
    layers = list(layout.layer_map.names)
    shards = snapshot_layers(layout, layers, pool, step=step)
    values = _values(shards)
    receipts = [store.write_shard(s, base=True) for s in shards]
    everyone: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(everyone, receipts)
    if layout.rank == 0:
        for i in range(len(layers)):
            store.commit([r[i] for r in everyone])
    torch.distributed.barrier()
    return values


def _load(layout: StateLayout, store_uri: str, step: int) -> None:
    store = LayerStore.open(store_uri, fsync=False)
    restorable = SimpleNamespace(layer_map=layout.layer_map, layout=layout)
    load_composite(restorable, store, resolve_plan(store, layout.layer_map.numel, step).records)


def save_and_restore_job(rank: int, world_size: int, store_uri: str, expect_dir: str) -> dict[str, Any]:
    """Train to ``SAVED``, store every layer, train on two steps, look once at a probe loss, restore
    from the store into the same run and replay the two steps; what each part saw."""
    model, optimizer = sharded_llama(world_size)
    layout = build_fsdp2_layout(model, optimizer, model_layer_map(model))
    losses = [train_step(model, optimizer, t, rank) for t in range(1, SAVED + 1)]
    saved = _store_all(layout, LayerStore.open(store_uri, fsync=False), SAVED)
    expected = full_state(model, optimizer)
    saved_probe = probe_loss(model)
    if rank == 0:
        from safetensors.torch import save_file

        save_file(expected, str(Path(expect_dir, EXPECTED)))
    after = [train_step(model, optimizer, t, rank) for t in (SAVED + 1, SAVED + 2)]
    moved = _same(saved, _values(snapshot_layers(layout, list(layout.layer_map.names), HostBufferPool(), step=0)))
    probe_loss(model)  # the root now holds gathered parameters of step SAVED + 2
    _load(layout, store_uri, SAVED)
    restored = _values(snapshot_layers(layout, list(layout.layer_map.names), HostBufferPool(), step=SAVED))
    replayed = [train_step(model, optimizer, t, rank) for t in (SAVED + 1, SAVED + 2)]
    return {
        "losses": losses + after,
        "replayed": replayed,
        "moved": len(moved),
        "mismatches": _same(saved, restored),
        "owned": {
            name: [[p.slice.name, p.slice.offset, p.slice.length] for p in e.owned] for name, e in layout.layers.items()
        },
        "probe_loss": saved_probe,
    }


def load_on_fewer_ranks_job(rank: int, world_size: int, store_uri: str, expect_dir: str) -> dict[str, Any]:
    """A fresh model sharded over this world size loads the stored step ``SAVED``; how its
    gathered state compares with the saver's, its Adam step counts, probe loss and next step."""
    from safetensors.torch import load_file

    model, optimizer = sharded_llama(world_size)
    layout = build_fsdp2_layout(model, optimizer, model_layer_map(model))
    _load(layout, store_uri, SAVED)
    got, expected = full_state(model, optimizer), load_file(str(Path(expect_dir, EXPECTED)))
    return {
        "mismatches": sorted(k for k in expected if not torch.equal(got[k], expected[k])),
        "keys": sorted(got) == sorted(expected),
        "adam_steps": sorted({optimizer_step_of(layout, name) for name in layout.layer_map.names}),
        "probe_loss": probe_loss(model),
        "next_loss": train_step(model, optimizer, SAVED + 1, rank),
    }


def refusals_job(rank: int, world_size: int) -> dict[str, str]:
    """What :func:`build_fsdp2_layout` says to placements it does not map, by case."""
    import transformers
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    out: dict[str, str] = {}

    def refusal(case: str, model: torch.nn.Module, layer_map: Any = None) -> None:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        try:
            build_fsdp2_layout(model, optimizer, layer_map or model_layer_map(model))
        except Exception as error:
            out[case] = f"{type(error).__name__}: {error}"
        else:
            out[case] = "accepted"

    config = transformers.LlamaConfig(**{k: v for k, v in TINY_LLAMA.items() if k != "model_type"})
    mesh = init_device_mesh("cpu", (world_size,))
    model = transformers.LlamaForCausalLM(config)
    fully_shard(model, mesh=mesh, shard_placement_fn=lambda p: Shard(1) if p.ndim > 1 else None)
    refusal("shard1", model)

    hsdp = transformers.LlamaForCausalLM(config)
    fully_shard(hsdp, mesh=init_device_mesh("cpu", (1, world_size), mesh_dim_names=("replicate", "shard")))
    refusal("hsdp", hsdp)

    linear = torch.nn.Linear(4, 4, bias=False)
    linear.weight = torch.nn.Parameter(distribute_tensor(linear.weight.detach(), mesh, [Replicate()]))
    refusal("replicate", linear, layer_map_from([("weight", (4, 4))], lambda name: "block.0"))
    return out


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(5, 3))  # 3 + 2 rows on 2 ranks
        self.v = torch.nn.Parameter(torch.randn(1, 4))  # 1 + 0 rows: rank 1's shard is empty

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + (self.w @ x).sum() * 1e-2 + self.v.sum()


class _Uneven(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([_Block(), _Block()])
        self.norm = torch.nn.Parameter(torch.randn(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x * self.norm
        for block in self.layers:
            out = block(out)
        return (out**2).mean()


def uneven_shards_job(rank: int, world_size: int, fused: bool) -> dict[str, Any]:
    """Parameters with fewer rows than ranks or rows that do not divide: the ranges each rank owns,
    whether all ranks' shards put together are the full state, and whether restoring them into
    state zeroed meanwhile brings it back."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from layercheck.workers.layer_state import ShardReader, restore_from_shards

    torch.manual_seed(3)
    model = _Uneven()
    mesh = init_device_mesh("cpu", (world_size,))
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=not fused, fused=fused)
    layout = build_fsdp2_layout(model, optimizer, model_layer_map(model))
    for t in range(2):
        model(torch.full((3,), float(t + 1))).backward()
        optimizer.step()
        optimizer.zero_grad()
    shards = snapshot_layers(layout, list(layout.layer_map.names), HostBufferPool(), step=2)
    everyone: list[Any] = [None] * world_size
    torch.distributed.all_gather_object(everyone, shards)
    every_shard = [s for rank_shards in everyone for s in rank_shards]
    read = ShardReader(every_shard)
    full = full_state(model, optimizer)
    whole = all(
        torch.equal(read(name, key, 0, tensor.numel()), tensor)
        for key_name, tensor in full.items()
        for key, name in [key_name.split("/", 1)]
    )
    with torch.no_grad():
        for param in model.parameters():
            param.zero_()
            optimizer.state[param]["exp_avg"].zero_()
            optimizer.state[param]["exp_avg_sq"].fill_(1.0)
    restore_from_shards(layout, shards)  # this rank's own shards cover what it needs
    back = full_state(model, optimizer)
    return {
        "owned": {p.slice.name: [p.slice.offset, p.slice.length] for e in layout.layers.values() for p in e.owned},
        "whole": whole,
        "restored": sorted(k for k in full if not torch.equal(full[k], back[k])),
    }
