"""Per-rank job for the drift probes on FSDP2 (tests/workers/test_drift_fsdp2.py), spawned by
tests/support/dist_harness.py: the tiny Llama under ``fully_shard`` on 2 gloo ranks, trained a few
steps in several runs, one per optimizer and set of probes.

Each run builds its probes before the first forward (as ``attach`` does); before the first step
and the second it loads a copy of the model's own weights the way a resume with ``assign=True``
under torch's swap-tensors mode does: every DTensor parameter keeps its identity (it keys the
optimizer's state) but gets a new local tensor, and FSDP2 re-pads the uneven ones (the odd
vocabulary splits the embedding and head 128 + 127 rows) — views a probe took of the old local
tensors would see nothing move, and a step through them would update memory the model no longer
reads. What each probe
reads is set against the L1 of each layer's local-shard change, from ``to_local()`` copies taken
before and after each step; the DTensor ops run inside each step and collect are counted; each
run's final local parameters and moments are compared, bit for bit, with a reference run's."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from layercheck.policies.layer_map import model_layer_map
from layercheck.workers.config import OptimConfig
from layercheck.workers.drift.adamw import DriftAdamW
from layercheck.workers.drift.diff import probe_for
from layercheck.workers.drift.probe import DriftReader, LayerDrift
from layercheck.workers.engine import param_groups
from layercheck.workers.engines.fsdp2 import build_fsdp2_layout
from tests.support.fsdp2_jobs import sharded_model
from tests.support.models import SEQ

STEPS = 3
VOCAB = 255
"""Odd: the embedding and the head hold 128 rows on rank 0 and 127 on rank 1."""
LR = 3e-3
SWAPPED_BEFORE = (1, 2)
"""The steps before which every local tensor is swapped: the first (the probes were built before
the first forward), and one after a step (a fused step's kept plan holds the old ones)."""


@dataclass(frozen=True, kw_only=True)
class Run:
    """One training run: the optimizer, the probes built on it (by ``probe_for`` kind, in order),
    and the run whose final state it must equal bit for bit."""

    name: str
    optimizer: str
    """``foreach``, ``fused`` or ``single``: torch's AdamW so; ``drift/<drift_step>``: DriftAdamW."""
    layer_groups: bool = False
    """The built-in loop's layer-aligned groups (``<layer>/decay|no_decay``), else decay and rest."""
    probes: tuple[str, ...] = ()
    refused: tuple[str, ...] = ()
    """Kinds ``probe_for`` is expected to refuse: what it says is returned."""
    every: int = 1
    same_as: str | None = None
    local_step: bool = False
    """Whether the probe takes the whole step (the fused step in place of torch's, DriftAdamW):
    then no op of it goes through DTensor's dispatch."""


RUNS = (
    Run(name="torch foreach", optimizer="foreach"),
    Run(
        name="foreach, fused probe",
        optimizer="foreach",
        probes=("fused", "snapshot_diff"),
        same_as="torch foreach",
        local_step=True,
    ),
    Run(name="foreach, auto", optimizer="foreach", probes=("auto",), same_as="torch foreach", local_step=True),
    Run(name="foreach, step_hooks", optimizer="foreach", probes=("step_hooks",), same_as="torch foreach"),
    Run(name="fused=True", optimizer="fused", probes=("auto", "step_hooks"), refused=("fused",)),
    Run(name="torch fused, layers", optimizer="fused", layer_groups=True),
    Run(name="torch single, layers", optimizer="single", layer_groups=True),
    Run(
        name="DriftAdamW auto",
        optimizer="drift/auto",
        layer_groups=True,
        probes=("auto", "snapshot_diff"),
        every=2,
        same_as="torch fused, layers",
        local_step=True,
    ),
    Run(
        name="DriftAdamW foreach",
        optimizer="drift/foreach",
        layer_groups=True,
        probes=("optimizer",),
        same_as="torch fused, layers",
        local_step=True,
    ),
    Run(
        name="DriftAdamW fused",
        optimizer="drift/auto",
        layer_groups=True,
        probes=("fused",),
        same_as="torch single, layers",
        local_step=True,
    ),
)


class DTensorOps(TorchDispatchMode):
    """Counts the ops dispatched with a DTensor among their arguments."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        from torch.distributed.tensor import DTensor

        self.count += any(issubclass(t, DTensor) for t in types)
        return func(*args, **(kwargs or {}))


def counted(fn: Callable[[], Any]) -> tuple[Any, int]:
    with DTensorOps() as ops:
        result = fn()
    return result, ops.count


def make_optimizer(run: Run, model: torch.nn.Module) -> torch.optim.Optimizer:
    if run.layer_groups:
        groups = param_groups(model, model_layer_map(model), OptimConfig(lr=LR, weight_decay=0.1))
    else:
        named = list(model.named_parameters())
        groups = [
            {"params": [p for _, p in named if p.ndim >= 2], "weight_decay": 0.1},
            {"params": [p for _, p in named if p.ndim < 2], "weight_decay": 0.0},
        ]
    if run.optimizer.startswith("drift/"):
        return DriftAdamW(groups, lr=LR, drift_step=run.optimizer.removeprefix("drift/"))
    kind = {"foreach": {"foreach": True}, "fused": {"fused": True}, "single": {"foreach": False}}[run.optimizer]
    return torch.optim.AdamW(groups, lr=LR, **kind)


def reload_swapping_local_tensors(model: torch.nn.Module) -> int:
    """Load a copy of the model's weights with ``assign=True`` under torch's swap-tensors mode;
    how many parameters' local tensors were swapped for new ones."""
    with torch.no_grad():
        before = {name: p.to_local() for name, p in model.named_parameters()}
        copy = {name: value.detach().clone() for name, value in model.state_dict().items()}
    swap = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        model.load_state_dict(copy, assign=True)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swap)
    with torch.no_grad():
        return sum(p.to_local() is not before[name] for name, p in model.named_parameters())


def local_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every parameter's local shard and its moments' and step count, copied."""
    out = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            state = optimizer.state[p]
            out[f"fp32/{name}"] = p.to_local().clone()
            for key in ("exp_avg", "exp_avg_sq"):
                out[f"{key}/{name}"] = state[key].to_local().clone()
            out[f"step/{name}"] = torch.tensor(float(state["step"]))
    return out


def collect_all(probes: dict[str, DriftReader], step: int) -> dict[str, LayerDrift]:
    return {kind: probe.collect(step) for kind, probe in probes.items()}


def _batch(step: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100_000 * step + rank)
    return torch.randint(0, VOCAB, (2, SEQ), generator=g)


def one_run(run: Run, rank: int, world_size: int) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Train ``run``; what its probes read against the exact local L1, per step."""
    model = sharded_model(world_size, vocab_size=VOCAB)
    optimizer = make_optimizer(run, model)
    layer_map = model_layer_map(model)
    layout = build_fsdp2_layout(model, optimizer, layer_map)
    refusals = {}
    for kind in run.refused:
        try:
            probe_for(layout, kind, every=run.every)
        except ValueError as error:
            refusals[kind] = str(error)
    probes = {kind: probe_for(layout, kind, every=run.every) for kind in run.probes}
    out: dict[str, Any] = {
        "probes": {
            kind: [type(p).__name__, getattr(p, "name", None), getattr(optimizer, "measured_step", None)]
            for kind, p in probes.items()
        },
        "refused": refusals,
        "swapped": [],
        "params": sum(1 for _ in model.parameters()),
        "steps": [],
    }
    params = dict(model.named_parameters())
    for step in range(1, STEPS + 1):
        if step in SWAPPED_BEFORE:
            out["swapped"].append(reload_swapping_local_tensors(model))
        ids = _batch(step, rank)
        model(input_ids=ids, labels=ids).loss.backward()
        with torch.no_grad():
            before = {name: p.to_local().clone() for name, p in params.items()}
        _, step_ops = counted(optimizer.step)
        with torch.no_grad():
            exact = {
                layer.name: sum(
                    float((params[p.name].to_local() - before[p.name]).double().abs().sum()) for p in layer.params
                )
                for layer in layer_map.layers
            }
        optimizer.zero_grad(set_to_none=True)
        read, collect_ops = counted(partial(collect_all, probes, step))
        out["steps"].append(
            {
                "exact": exact,
                "read": {kind: (d.l1 if d.measured else None) for kind, d in read.items()},
                "numel": {kind: dict(d.numel) for kind, d in read.items()},
                "step_ops": step_ops,
                "collect_ops": collect_ops,
            }
        )
    out["local_numel"] = {
        layer.name: sum(params[p.name].to_local().numel() for p in layer.params) for layer in layer_map.layers
    }
    return out, local_state(model, optimizer)


def drift_probes_job(rank: int, world_size: int) -> dict[str, Any]:
    """Every run of :data:`RUNS`, by name; each with ``differs``: the keys of its final local
    state that differ bit for bit from its ``same_as`` run's."""
    results, states = {}, {}
    for run in RUNS:
        results[run.name], states[run.name] = one_run(run, rank, world_size)
        if run.same_as is not None:
            mine, theirs = states[run.name], states[run.same_as]
            results[run.name]["differs"] = sorted(k for k in theirs if not torch.equal(mine[k], theirs[k]))
    return results
