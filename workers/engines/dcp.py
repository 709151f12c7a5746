"""An FSDP2 model and its optimizer as a PyTorch Distributed Checkpoint (DCP), the format FSDP2 and
torchtitan users checkpoint with: what ``layercheck export --format dcp`` writes
(:mod:`layercheck.orchestrator.offline.export_dcp`). Here because ``torch.distributed.checkpoint`` is
an engine's own library, which only the engine adapters import (``tests/repo/test_layering.py``).

The state saved is ``{"model": ..., "optim": ...}`` as ``get_state_dict(model, optimizer)`` gives
them with :func:`state_dict_options`: the optimizer's state flattened (as torchtitan saves it), every
moment and param-group hyper-parameter under its parameter's name. The nested default keeps the
param groups as a list that ``set_state_dict`` matches to the loader's groups by position: a loader
grouped otherwise than the saver (the built-in loop keeps one group per layer and decay kind) lost
its groups' learning rate and betas that way (found by ``tests/orchestrator/offline/test_export_dcp.py``).
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

logger = logging.getLogger(__name__)

#: The top-level keys of the saved state dict: ``get_state_dict``'s model and optimizer parts.
MODEL_KEY, OPTIM_KEY = "model", "optim"


def state_dict_options() -> StateDictOptions:
    """The ``StateDictOptions`` a checkpoint is saved with, and must be loaded with."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(flatten_optimizer_state_dict=True)


def save_dcp(model: torch.nn.Module, optimizer: torch.optim.Optimizer, path: str | os.PathLike[str]) -> None:
    """Save ``model`` (sharded with ``fully_shard``) and ``optimizer`` as a DCP checkpoint at ``path``
    (collective: every rank of the model's mesh calls it). Each group's ``foreach`` is saved unset
    (torch's default): it is a kernel choice, which LayerCheck's drift step makes for itself (off),
    not a hyper-parameter the loader's optimizer should take."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, flattened = get_state_dict(model, optimizer, options=state_dict_options())
    optim_state: dict[str, Any] = dict(flattened)  # one value per key
    for key in [k for k in optim_state if k.startswith("param_groups.") and k.endswith(".foreach")]:
        optim_state[key] = None
    dcp.save({MODEL_KEY: model_state, OPTIM_KEY: optim_state}, checkpoint_id=str(path))
    logger.info("saved the model and optimizer as a DCP checkpoint at %s", path)
