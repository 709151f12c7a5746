"""Per-rank jobs for the DCP export test (spawned by tests/support/dist_harness.py): what an FSDP2
user does with a ``layercheck export --format dcp`` checkpoint. Their own model (the tied tiny Llama,
built from its config, sharded with ``fully_shard`` per decoder layer and root over this world size)
and their own AdamW (a decay and a no-decay group) take the checkpoint through ``dcp.load`` and
``set_state_dict``; rank 0 writes every parameter's full weights and moments, gathered with DTensor's
``full_tensor()``, for the test to compare with the composite. No LayerCheck code loads anything here."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tests.support.fsdp2_jobs import full_state
from tests.support.models import TIED_LLAMA

LOADED = "loaded.safetensors"


def users_fsdp2_model(world_size: int) -> tuple[torch.nn.Module, torch.optim.AdamW]:
    """The tied tiny Llama under ``fully_shard`` over ``world_size`` CPU ranks (another seed than the
    run's: every value must come from the checkpoint), and AdamW over a decay and a no-decay group."""
    import transformers
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(12345)
    sizes = {k: v for k, v in TIED_LLAMA.items() if k != "model_type"}
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**sizes))
    mesh = init_device_mesh("cpu", (world_size,))
    for block in model.model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    decay = [p for p in model.parameters() if p.ndim >= 2]
    rest = [p for p in model.parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.5}, {"params": rest, "weight_decay": 0.0}], lr=0.25
    )
    return model, optimizer


def load_dcp_job(rank: int, world_size: int, checkpoint: str, out_dir: str) -> dict[str, Any]:
    """Load ``checkpoint`` as docs/export.md says; per parameter its Adam step count, the param groups'
    hyper-parameters, and (rank 0, to ``out_dir``) the full state."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

    model, optimizer = users_fsdp2_model(world_size)
    options = StateDictOptions(flatten_optimizer_state_dict=True)
    model_state, optim_state = get_state_dict(model, optimizer, options=options)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=checkpoint)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"], options=options)
    loaded = full_state(model, optimizer)
    if rank == 0:
        from safetensors.torch import save_file

        save_file(loaded, str(Path(out_dir, LOADED)))
    return {
        "steps": {name: float(optimizer.state[p]["step"]) for name, p in model.named_parameters()},
        "groups": [
            {"lr": g["lr"], "weight_decay": g["weight_decay"], "betas": list(g["betas"]), "foreach": g["foreach"]}
            for g in optimizer.param_groups
        ],
        "local_rows": {name: int(p.to_local().shape[0]) for name, p in model.named_parameters()},
    }
