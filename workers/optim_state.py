"""The optimizer state LayerCheck reads and writes, for every Adam-family optimizer it supports.

A layer state is the fp32 master weights plus Adam's ``exp_avg`` / ``exp_avg_sq`` and step
count. Optimizers keep these in slightly different forms: torch's ``Adam``/``AdamW`` (and our
``DriftAdamW``) hold ``step`` as a 0-d tensor, DeepSpeed's ``FusedAdam`` and ``DeepSpeedCPUAdam``
as a Python int. This module hides that difference, and refuses (before training starts) an
optimizer whose state is not Adam's: restoring its layers could not be exact.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch.optim.optimizer import _get_scalar_dtype

from layercheck.workers.drift.adamw import DriftAdamW

logger = logging.getLogger(__name__)

#: Class names of the optimizers whose per-parameter state is ``step``, ``exp_avg``, ``exp_avg_sq``.
SUPPORTED_OPTIMIZERS: tuple[str, ...] = ("Adam", "AdamW", "DriftAdamW", "FusedAdam", "DeepSpeedCPUAdam")


class UnsupportedOptimizerError(TypeError):
    """The client optimizer is not one whose state LayerCheck can snapshot and restore exactly."""


def check_supported(optimizer: torch.optim.Optimizer) -> None:
    """Raise :class:`UnsupportedOptimizerError` unless ``optimizer`` is an Adam-family optimizer."""
    names = {cls.__name__ for cls in type(optimizer).__mro__}
    if not names & set(SUPPORTED_OPTIMIZERS):
        raise UnsupportedOptimizerError(
            f"LayerCheck cannot checkpoint the optimizer {type(optimizer).__module__}.{type(optimizer).__name__}: "
            f"a layer state is Adam's (exp_avg, exp_avg_sq, step); supported are {', '.join(SUPPORTED_OPTIMIZERS)} "
            '(in a DeepSpeed config: "optimizer": {"type": "AdamW"} or "Adam", or a torch.optim.AdamW you pass '
            "to deepspeed.initialize)"
        )
    if any(group.get("amsgrad") for group in optimizer.param_groups):
        raise UnsupportedOptimizerError(
            "LayerCheck does not support amsgrad=True (its max_exp_avg_sq is not persisted)"
        )


def init_state(optimizer: torch.optim.Optimizer, master: torch.Tensor) -> dict[str, Any]:
    """``master``'s state, created as the optimizer would before its first step if missing
    (a restore into a fresh engine needs moments to write into)."""
    if isinstance(optimizer, DriftAdamW):  # it makes its state as its own step keeps it
        return optimizer.init_state(master)
    state = optimizer.state[master]
    if len(state) == 0:
        state["step"] = _zero_step(optimizer, master)
        state["exp_avg"] = torch.zeros_like(master, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(master, memory_format=torch.preserve_format)
    return state


def _zero_step(optimizer: torch.optim.Optimizer, master: torch.Tensor) -> torch.Tensor | int:
    if isinstance(optimizer, torch.optim.Optimizer) and type(optimizer).__module__.startswith("torch."):
        group = optimizer.param_groups[0]
        on_device = group.get("fused") or group.get("capturable")
        dtype = _get_scalar_dtype(is_fused=bool(group.get("fused")))  # torch's own choice (float32 by default)
        return torch.zeros((), dtype=dtype, device=master.device if on_device else "cpu")
    return 0  # DeepSpeed's FusedAdam / CPUAdam count in a Python int


def get_step(optimizer: torch.optim.Optimizer, master: torch.Tensor) -> int:
    """The Adam step count of ``master`` (0 before its first step)."""
    state = optimizer.state.get(master)
    if not state or "step" not in state:
        return 0
    return int(state["step"])


def set_step(optimizer: torch.optim.Optimizer, master: torch.Tensor, step: int) -> None:
    """Set ``master``'s Adam step count, keeping the optimizer's own representation."""
    state = init_state(optimizer, master)
    if isinstance(state["step"], torch.Tensor):
        state["step"].fill_(float(step))
    else:
        state["step"] = int(step)
