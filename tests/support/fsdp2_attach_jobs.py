"""Per-rank jobs for tests/workers/test_attach_fsdp2.py (spawned by tests/support/dist_harness.py)."""

from __future__ import annotations

from typing import Any

import torch

from tests.support.models import SEQ, TINY_LLAMA


def lora_job(rank: int, world_size: int) -> dict[str, Any]:
    """A peft LoRA adapter on the tiny Llama, sharded with fully_shard, attached and trained two steps:
    the layers LayerCheck tracks, their sizes, the drift and the shards it snapshots."""
    import peft
    import transformers
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from layercheck.workers.attached import attach_engine
    from layercheck.workers.host_buffers import HostBufferPool
    from layercheck.workers.layer_state import snapshot_layers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(**{k: v for k, v in TINY_LLAMA.items() if k != "model_type"})
    model = peft.get_peft_model(transformers.LlamaForCausalLM(config), peft.LoraConfig(r=4, target_modules=["q_proj"]))
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in model.base_model.model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    attached = attach_engine(model, optimizer)
    ids = torch.randint(0, TINY_LLAMA["vocab_size"], (2, SEQ), generator=torch.Generator().manual_seed(rank))
    for step in (1, 2):
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        drift = attached.probe.collect(step)
    shards = snapshot_layers(attached.layout, list(attached.layer_map.names), HostBufferPool())
    return {
        "numel": dict(attached.layer_map.numel),
        "params": sorted(p.name for layer in attached.layer_map.layers for p in layer.params),
        "drift": drift.l1,
        "snapshot": {s.layer: s.tensors["fp32"].numel() for s in shards},
        "step": attached.adapter.steps_taken(),
    }
