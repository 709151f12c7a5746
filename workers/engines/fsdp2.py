"""PyTorch FSDP2's state as a :class:`~layercheck.workers.layout.StateLayout`.

``fully_shard`` (each decoder layer, then the root) over a 1-D device mesh makes every parameter
a DTensor placed ``(Shard(0),)``: this rank holds a contiguous run of rows, so a contiguous run of
the flattened parameter's elements, which torch's ``Adam``/``AdamW`` step in place, and the
moments ``exp_avg``/``exp_avg_sq`` are DTensors placed alike. No other rank holds that run, so a
rank owns and needs exactly it (as at ZeRO-3). Where the run starts is read from the DTensor
itself (the chunk ``torch.distributed.checkpoint`` saves), so uneven and empty shards need no
arithmetic here.

HSDP (``fully_shard`` over a 2-D replicate x shard mesh) places parameters ``(Replicate(), Shard(0))``:
the ranks along the replicate dimension hold the same shard. Each needs all of it, and owns (writes,
measures the drift of) a ``1/replicas`` run of it, so every element is written once however many
replicas there are; a survivor's capture is its whole shard, so a lost replica's run comes back
from a live twin, exact.

A layer's masters are its DTensor parameters: they key the optimizer's state (moments and step
count), and :func:`~layercheck.workers.layout.local_part` reads their local shard at each access
(FSDP2 may swap a parameter's local tensor for a re-padded one when it initialises lazily).

:class:`FSDP2Adapter` is FSDP2 behind LayerCheck's engine protocol: a user's ``fully_shard`` model,
optimizer and scheduler (``layercheck.attach(model, optimizer, lr_scheduler=...)``), or the built-in
loop's (:func:`build_fsdp2`). FSDP2 keeps no step counter: the adapter counts the optimizer's steps
(a post-step hook) and moves it, and the scheduler, on a seek.

One private torch name is used: ``torch.distributed.checkpoint.state_dict._get_fqns`` (a
parameter's canonical name, as DCP saves it), checked with torch 2.13.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import TYPE_CHECKING, Literal

import torch

from layercheck.policies.layer_map import Layer, LayerMap
from layercheck.workers import optim_state
from layercheck.workers.config import EngineConfig
from layercheck.workers.data.batch import MicroBatch, model_inputs
from layercheck.workers.layout import LayerLayout, Piece, StateLayout, local_part, zero0_owned_range
from layercheck.workers.lr_schedule import seek_scheduler
from layercheck.workers.shard import ParamSlice

if TYPE_CHECKING:
    from torch.optim.lr_scheduler import LRScheduler

logger = logging.getLogger(__name__)

#: What this layout maps, for the refusals.
SUPPORTED_SHARDING = (
    "a model sharded with torch.distributed.fsdp.fully_shard (each decoder layer, then the root) "
    "over a mesh of all ranks, 1-D (its parameters DTensors placed (Shard(dim=0),)) or HSDP's 2-D "
    "replicate x shard mesh (placed (Replicate(), Shard(dim=0)))"
)
SUPPORTED_OPTIMIZERS = "torch.optim.Adam or torch.optim.AdamW (foreach or fused, any param groups)"


class UnsupportedShardingError(TypeError):
    """A parameter is not placed the way :func:`build_fsdp2_layout` maps."""


def build_fsdp2_layout(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    layer_map: LayerMap,
    steps_taken: Callable[[], int] = lambda: 0,
) -> StateLayout:
    """Map every layer of ``layer_map`` onto ``model``'s FSDP2 shards and ``optimizer``'s state.

    Raises :class:`~layercheck.workers.optim_state.UnsupportedOptimizerError` for an optimizer other
    than torch's Adam/AdamW, :class:`UnsupportedShardingError` for a parameter that is not a DTensor
    placed ``(Shard(0),)`` on a 1-D mesh of every rank, ``KeyError`` for a layer-map parameter the
    model does not have, ``ValueError`` for one no param group holds.
    """
    check_optimizer(optimizer)
    params = named_parameters(model)
    missing = [p.name for layer in layer_map.layers for p in layer.params if p.name not in params]
    if missing:
        raise KeyError(f"the layer map names parameters the model does not have: {missing[:8]}")
    for layer in layer_map.layers:
        for info in layer.params:
            check_placement(info.name, params[info.name])
    group_of = _group_of(optimizer, params, layer_map)
    layers = {layer.name: _layer_layout(layer, params, optimizer, group_of) for layer in layer_map.layers}
    rank, world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
    logger.info(
        "state layout: FSDP2, rank %d of %d, %d layers over %d param groups (%s)",
        rank,
        world_size,
        len(layers),
        len(optimizer.param_groups),
        type(optimizer).__name__,
    )
    return StateLayout(
        stage=3,  # partitioned like ZeRO-3: a rank needs exactly its shard (owns it, or its replica's run of it)
        rank=rank,
        world_size=world_size,
        layers=layers,
        layer_map=layer_map,
        optimizer=optimizer,
        steps_taken=steps_taken,
        refresh=partial(reshard_all, model),
        kind="fsdp2",
        subgroups=any(replica_of(params[p.name])[1] > 1 for layer in layer_map.layers for p in layer.params),
    )


def check_optimizer(optimizer: object) -> None:
    """Raise :class:`~layercheck.workers.optim_state.UnsupportedOptimizerError` unless ``optimizer``
    is torch's Adam or AdamW (AdamW subclasses Adam) without amsgrad."""
    if not isinstance(optimizer, torch.optim.Adam):
        raise optim_state.UnsupportedOptimizerError(
            f"LayerCheck cannot checkpoint the optimizer {type(optimizer).__module__}.{type(optimizer).__name__} "
            f"of an FSDP2 model: a layer state is Adam's (exp_avg, exp_avg_sq, step); use {SUPPORTED_OPTIMIZERS}"
        )
    optim_state.check_supported(optimizer)  # amsgrad


def check_placement(name: str, param: torch.Tensor) -> None:
    """Raise :class:`UnsupportedShardingError` unless ``param`` is a DTensor placed ``(Shard(0),)``
    on a 1-D mesh of every rank, or ``(Replicate(), Shard(0))`` on HSDP's 2-D mesh of every rank."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if not isinstance(param, DTensor):
        raise UnsupportedShardingError(
            f"parameter {name!r} is a {type(param).__name__}, not a DTensor (a model not sharded with fully_shard, "
            f"or FSDP1's FullyShardedDataParallel); LayerCheck's FSDP2 layout maps {SUPPORTED_SHARDING}"
        )
    mesh, placements = param.device_mesh, tuple(param.placements)
    if placements not in ((Shard(0),), (Replicate(), Shard(0))):
        raise UnsupportedShardingError(
            f"parameter {name!r} is placed {placements} on a {mesh.ndim}-D mesh of shape {tuple(mesh.shape)}; "
            f"LayerCheck's FSDP2 layout maps {SUPPORTED_SHARDING} (Shard(1) and tensor parallelism are "
            "not supported yet)"
        )
    if mesh.size() != torch.distributed.get_world_size():
        raise UnsupportedShardingError(
            f"parameter {name!r} is sharded over {mesh.size()} of {torch.distributed.get_world_size()} ranks; "
            f"LayerCheck's FSDP2 layout maps {SUPPORTED_SHARDING}"
        )


def named_parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``model``'s parameters by name, each also under its canonical FQN where that differs
    (torch's own mapping: without activation-checkpoint wrappers, ``torch.compile``'s ``_orig_mod.``)."""
    from torch.distributed.checkpoint.state_dict import _get_fqns

    out: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters():
        out[name] = param
        for fqn in _get_fqns(model, name):
            out.setdefault(fqn, param)
    return out


def shard_range(param: torch.Tensor) -> tuple[int, int]:
    """(offset, length) of this rank's shard of ``param`` (a DTensor placed ``(Shard(0),)``) in
    the flattened parameter: its first row times the row length, and its element count."""
    chunks = param.__create_chunk_list__()  # type: ignore[attr-defined]  # DTensor's chunk, as DCP saves it
    if len(chunks) != 1:
        raise UnsupportedShardingError(f"a DTensor with {len(chunks)} local chunks, expected one")
    offsets, sizes = tuple(chunks[0].offsets), tuple(chunks[0].sizes)
    if any(offsets[1:]) or sizes[1:] != tuple(param.shape[1:]):
        raise UnsupportedShardingError(
            f"a shard at {offsets} of size {sizes} is not whole rows of {tuple(param.shape)}"
        )
    row = math.prod(param.shape[1:])
    length = math.prod(sizes)
    return (offsets[0] * row if length else 0), length


def replica_of(param: torch.Tensor) -> tuple[int, int]:
    """(this rank's replica, the replicas) of ``param``'s shard: ``(0, 1)`` on a 1-D mesh; on HSDP's
    2-D mesh, the rank's coordinate along the replicate dimension and its size. Every replica holds
    the same shard, so each writes a ``1/replicas`` run of it (as ZeRO-0's ranks split their writes)
    and needs all of it on restore."""
    mesh = param.device_mesh  # type: ignore[attr-defined]
    if mesh.ndim == 1:
        return 0, 1
    return int(mesh.get_local_rank(0)), int(mesh.size(0))


def reshard_all(model: torch.nn.Module, layers: Sequence[str] = ()) -> None:
    """Make the next forward all-gather every FSDP module's parameters from the sharded masters
    a restore wrote: free the unsharded copies any module still holds (the root keeps its own
    after a forward until the backward). Not collective; ``layers`` is the layout's ``refresh``
    signature: resharding is per module and cheap, so all are."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def _group_of(
    optimizer: torch.optim.Optimizer, params: Mapping[str, torch.Tensor], layer_map: LayerMap
) -> dict[str, int]:
    index_of = {id(p): i for i, group in enumerate(optimizer.param_groups) for p in group["params"]}
    group_of = {p.name: index_of.get(id(params[p.name]), -1) for layer in layer_map.layers for p in layer.params}
    orphans = [name for name, index in group_of.items() if index < 0]
    if orphans:
        raise ValueError(f"no param group of the optimizer holds the trainable parameter(s) {orphans[:8]}")
    return group_of


def _layer_layout(
    layer: Layer, params: Mapping[str, torch.Tensor], optimizer: torch.optim.Optimizer, group_of: Mapping[str, int]
) -> LayerLayout:
    needed: list[Piece] = []
    owned: list[Piece] = []
    for info in layer.params:
        param = params[info.name]
        offset, length = shard_range(param)
        if length:  # an empty shard (fewer rows than ranks) holds nothing of this parameter
            needed.append(Piece(ParamSlice(info.name, info.shape, offset, length), param, 0))
            replica, replicas = replica_of(param)
            start, count = zero0_owned_range(length, replica, replicas)  # HSDP: the replicas split the shard's writes
            if count:
                owned.append(Piece(ParamSlice(info.name, info.shape, offset + start, count), param, start))
        state = optim_state.init_state(optimizer, param)  # a restore into a fresh optimizer writes into these
        _check_moments(info.name, param, state)
    indices = sorted({group_of[p.name] for p in layer.params})
    return LayerLayout(
        name=layer.name,
        owned=tuple(owned),
        needed=tuple(needed),
        masters=tuple(params[p.name] for p in layer.params),
        groups=tuple(optimizer.param_groups[i] for i in indices),
        group_params=tuple(tuple(p.name for p in layer.params if group_of[p.name] == i) for i in indices),
        group_indices=tuple(indices),
    )


def _check_moments(name: str, param: torch.Tensor, state: Mapping[str, torch.Tensor]) -> None:
    """The moments must hold this rank's elements as the parameter does (torch's Adam makes them
    with ``zeros_like`` of the DTensor parameter): else their local views would misalign."""
    want = tuple(local_part(param).shape)
    for key in ("exp_avg", "exp_avg_sq"):
        got = tuple(local_part(state[key]).shape)
        if got != want or not local_part(state[key]).is_contiguous():
            raise UnsupportedShardingError(
                f"parameter {name!r}'s {key} holds a local shard of shape {got}, the parameter {want}: "
                "its optimizer state is not placed like the parameter"
            )


class FSDP2Adapter:
    """A ``fully_shard`` model, its optimizer and (optionally) its scheduler as a
    :class:`~layercheck.workers.engines.base.TrainingEngine`. Raises before any step:
    :class:`UnsupportedShardingError` for a model not sharded with ``fully_shard`` (FSDP1's
    ``FullyShardedDataParallel`` included), ``UnsupportedOptimizerError`` for a non-Adam optimizer."""

    @property
    def kind(self) -> Literal["fsdp2"]:
        return "fsdp2"

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        lr_scheduler: LRScheduler | None = None,
        *,
        grad_clip: float = 0.0,
        grad_accum: int | None = None,
    ) -> None:
        check_model(model)
        check_optimizer(optimizer)
        self._model = model
        self._optimizer = optimizer
        self._scheduler = lr_scheduler
        self._grad_clip = grad_clip
        self._grad_accum = grad_accum
        self._steps = 0
        self._hook = optimizer.register_step_post_hook(self._count)

    def _count(self, optimizer: torch.optim.Optimizer, args: tuple[object, ...], kwargs: dict[str, object]) -> None:
        self._steps += 1

    @property
    def native(self) -> torch.nn.Module:
        return self._model

    @property
    def module(self) -> torch.nn.Module:
        return self._model

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self._optimizer

    def describe(self) -> str:
        return f"FSDP2 over {torch.distributed.get_world_size()} ranks"

    def build_layout(self, layer_map: LayerMap) -> StateLayout:
        return build_fsdp2_layout(self._model, self._optimizer, layer_map, self.steps_taken)

    def steps_taken(self) -> int:
        return self._steps

    def current_lr(self) -> float:
        return float(self._optimizer.param_groups[0]["lr"])

    def seek(self, step: int) -> None:
        """The step count and the scheduler (stepped ``step`` times if a torch one the user made,
        as training would have; the built-in loop's is set there at once)."""
        self._steps = step
        seek_scheduler(self._scheduler, step)
        logger.info("FSDP2 engine moved to step %d (lr %.3g)", step, self.current_lr())

    def train_step(self, micro_batches: Sequence[MicroBatch]) -> float:
        """Forward and backward each micro-batch (its loss over the count, as DeepSpeed scales it),
        clip the gradients' global norm, step the optimizer and the scheduler."""
        if self._grad_accum is not None and len(micro_batches) != self._grad_accum:
            raise ValueError(f"expected {self._grad_accum} micro-batches, got {len(micro_batches)}")
        device = self._device()
        total = torch.zeros((), device=device)
        for micro_batch in micro_batches:
            loss = self._model(**model_inputs(micro_batch, device)).loss
            (loss / len(micro_batches)).backward()
            total += loss.detach().float()
        if self._grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self._model.parameters(), self._grad_clip)
        self._optimizer.step()
        if self._scheduler is not None:
            self._scheduler.step()
        self._optimizer.zero_grad(set_to_none=True)
        return float(total) / len(micro_batches)

    @torch.no_grad()
    def eval_loss(self, micro_batch: MicroBatch) -> float:
        return float(self._model(**model_inputs(micro_batch, self._device())).loss)

    def release(self) -> None:
        """Nothing to free but the step counter's hook: the sharded model goes with the process's
        references to it (a new group needs a model sharded over its own mesh)."""
        self._hook.remove()

    def _device(self) -> torch.device:
        first = next(iter(self._model.parameters()))
        return local_part(first).device


def check_model(model: object) -> None:
    """Raise :class:`UnsupportedShardingError` unless ``model`` is a module sharded with
    ``fully_shard`` at its root (FSDP2); FSDP1 and a DeepSpeed engine are named."""
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    if hasattr(model, "zero_optimization_stage"):
        raise TypeError(
            "got a DeepSpeedEngine and an optimizer: for DeepSpeed call layercheck.attach(engine) alone "
            "(its optimizer is the engine's); attach(model, optimizer, lr_scheduler=...) is for FSDP2"
        )
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"expected the model sharded with fully_shard, got {type(model).__name__}")
    if any(isinstance(m, FullyShardedDataParallel) for m in model.modules()):
        raise UnsupportedShardingError(
            "the model is wrapped in FSDP1's FullyShardedDataParallel, which LayerCheck does not map "
            "(transformers and torch deprecate it); shard it with torch.distributed.fsdp.fully_shard "
            "(FSDP2: each decoder layer, then the root), or use DeepSpeed"
        )
    if not isinstance(model, FSDPModule):
        raise UnsupportedShardingError(
            f"the {type(model).__name__} is not sharded with fully_shard at its root; LayerCheck's FSDP2 "
            f"support maps {SUPPORTED_SHARDING}: call fully_shard(model, mesh=mesh) after the layers'"
        )


def decoder_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules to shard one by one: those of the classes transformers keeps whole
    (``model._no_split_modules``: the decoder layers), as accelerate's transformer auto-wrap does."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    blocks = [m for m in model.modules() if type(m).__name__ in names]
    if not blocks:
        raise UnsupportedShardingError(
            f"cannot find the decoder layers of a {type(model).__name__} to shard (its _no_split_modules "
            f"is {sorted(names) or 'empty'}); the built-in loop's FSDP2 needs a transformers causal LM"
        )
    return blocks


def build_fsdp2(
    model: torch.nn.Module,
    make_optimizer: Callable[[torch.nn.Module], torch.optim.Optimizer],
    make_scheduler: Callable[[torch.optim.Optimizer], LRScheduler],
    cfg: EngineConfig,
) -> FSDP2Adapter:
    """The built-in loop's FSDP2 engine: ``model`` sharded with ``fully_shard`` (each decoder layer,
    then the root) over a 1-D mesh of every rank of the default group, bf16 compute over fp32
    sharded masters where ``cfg.precision`` says so, and the optimizer and scheduler made here over
    the sharded parameters."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if cfg.micro_batch < 1:
        raise ValueError(f"micro_batch must be at least 1, got {cfg.micro_batch}")
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    if device_type == "cuda":
        model.to(torch.device("cuda", torch.cuda.current_device()))
    mesh = init_device_mesh(device_type, (torch.distributed.get_world_size(),))
    precision = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if cfg.precision == "bf16"
        else MixedPrecisionPolicy()
    )
    for block in decoder_blocks(model):
        fully_shard(block, mesh=mesh, mp_policy=precision)
    fully_shard(model, mesh=mesh, mp_policy=precision)
    optimizer = make_optimizer(model)
    return FSDP2Adapter(model, optimizer, make_scheduler(optimizer), grad_clip=cfg.grad_clip, grad_accum=cfg.grad_accum)
