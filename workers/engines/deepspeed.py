"""DeepSpeed (ZeRO 0-3) behind LayerCheck's engine protocol.

:class:`DeepSpeedAdapter` wraps a ``DeepSpeedEngine`` (the user's, from ``deepspeed.initialize``, or the
built-in loop's, :func:`build_deepspeed`); :func:`build_deepspeed_layout` maps its optimizer state, for
every ZeRO stage, onto a :class:`~layercheck.workers.layout.StateLayout`.

Ownership: ZeRO 1-3 partition the fp32 state, so a rank owns (and needs) exactly its fragment.
ZeRO-0 replicates it; a rank *owns* the ``rank``-th contiguous ``1/world_size`` slice of each
parameter (so ranks split the writes instead of each writing a copy) but *needs* the whole
parameter on restore.

Param groups need not follow layers: a layer's masters and groups are the fp32 tensors and
client param groups that hold any of its parameters (one group for all, decay/no-decay
groups, or LayerCheck's own layer-aligned groups), so several layers may share one master.
DeepSpeed's private attributes are read only through :mod:`layercheck.workers.engines.ds_internals`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Literal

import torch

from layercheck.policies.layer_map import LayerMap
from layercheck.workers import env, optim_state
from layercheck.workers.config import EngineConfig
from layercheck.workers.data.batch import MicroBatch, model_inputs
from layercheck.workers.engines import ds_internals
from layercheck.workers.layout import LayerLayout, Piece, StateLayout, parameters_by_name, zero0_owned_range
from layercheck.workers.lr_schedule import seek_scheduler
from layercheck.workers.shard import ParamSlice

if TYPE_CHECKING:
    from deepspeed import DeepSpeedEngine
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
    from torch.optim.lr_scheduler import LRScheduler

logger = logging.getLogger(__name__)


def is_deepspeed_engine(candidate: object) -> bool:
    """Whether ``candidate`` is a ``DeepSpeedEngine`` (duck-typed: importing DeepSpeed costs seconds)."""
    return hasattr(candidate, "zero_optimization_stage") and hasattr(candidate, "module")


def find_deepspeed_engine(engine: object) -> DeepSpeedEngine | None:
    """The ``DeepSpeedEngine`` behind ``engine`` (Accelerate and HF wrappers keep it as ``.engine``
    or ``.model_wrapped``), or ``None``."""
    for candidate in (engine, getattr(engine, "model_wrapped", None), getattr(engine, "engine", None)):
        if candidate is not None and is_deepspeed_engine(candidate):
            return candidate
    return None


@dataclass(eq=False)
class DeepSpeedAdapter:
    """A ``DeepSpeedEngine`` as a :class:`~layercheck.workers.engines.base.TrainingEngine`."""

    engine: DeepSpeedEngine

    @property
    def kind(self) -> Literal["deepspeed"]:
        return "deepspeed"

    def __post_init__(self) -> None:
        if ds_internals.client_optimizer(self.engine) is None:
            raise ValueError(
                "the engine has no optimizer: pass one to deepspeed.initialize or name one in the "
                'DeepSpeed config ("optimizer": {"type": "AdamW", ...})'
            )

    @property
    def native(self) -> DeepSpeedEngine:
        return self.engine

    @property
    def module(self) -> torch.nn.Module:
        module: torch.nn.Module = self.engine.module
        return module

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        optimizer: torch.optim.Optimizer = ds_internals.client_optimizer(self.engine)
        return optimizer

    def describe(self) -> str:
        return f"DeepSpeed ZeRO-{int(self.engine.zero_optimization_stage())}"

    def build_layout(self, layer_map: LayerMap) -> StateLayout:
        return build_deepspeed_layout(self.engine, layer_map)

    def steps_taken(self) -> int:
        return int(self.engine.global_steps)

    def current_lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def seek(self, step: int) -> None:
        """DeepSpeed's counters and ``engine.lr_scheduler`` (DeepSpeed's own schedulers jump there;
        a torch scheduler is stepped ``step`` times, which is what training would have done; the
        built-in loop's ``LambdaLR`` is set there directly). A scheduler the user steps outside
        the engine is theirs to move."""
        engine = self.engine
        engine.global_steps = step
        engine.global_samples = step * engine.train_batch_size()
        engine.micro_steps = step * engine.gradient_accumulation_steps()
        seek_scheduler(getattr(engine, "lr_scheduler", None), step)
        logger.info("engine moved to step %d (lr %.3g)", step, self.current_lr())

    def train_step(self, micro_batches: Sequence[MicroBatch]) -> float:
        engine = self.engine
        if len(micro_batches) != engine.gradient_accumulation_steps():
            raise ValueError(f"expected {engine.gradient_accumulation_steps()} micro-batches, got {len(micro_batches)}")
        device = torch.device(engine.device)
        total = torch.zeros((), device=device)
        for micro_batch in micro_batches:
            loss = engine(**model_inputs(micro_batch, device)).loss
            engine.backward(loss)
            engine.step()
            total += loss.detach().float()
        return float(total) / len(micro_batches)

    @torch.no_grad()
    def eval_loss(self, micro_batch: MicroBatch) -> float:
        return float(self.engine(**model_inputs(micro_batch, torch.device(self.engine.device))).loss)

    def release(self) -> None:
        """``engine.destroy()``. On the way out of a lost group, Ray Train's teardown may have
        destroyed the process group already (from another thread of the worker), and ZeRO-3's
        release then fails asking for its rank: that error is logged, not raised, so it does not
        replace the error the rank is leaving with (the peer's loss)."""
        try:
            self.engine.destroy()
        except Exception as error:
            if torch.distributed.is_initialized():
                raise
            logger.info("the engine's release found its process group gone (a lost group's teardown): %r", error)


def build_deepspeed_layout(engine: DeepSpeedEngine, layer_map: LayerMap) -> StateLayout:
    """Map every layer of ``layer_map`` onto ``engine``'s optimizer state on this rank.

    Raises :class:`~layercheck.workers.optim_state.UnsupportedOptimizerError` for an optimizer whose state
    is not Adam's, and ``KeyError`` for a layer-map parameter the engine's model does not have.
    """
    stage = int(engine.zero_optimization_stage())
    rank, world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
    optimizer = ds_internals.client_optimizer(engine)
    optim_state.check_supported(optimizer)
    params = parameters_by_name(engine.module)
    missing = [p.name for layer in layer_map.layers for p in layer.params if p.name not in params]
    if missing:
        raise KeyError(f"the layer map names parameters the model does not have: {missing[:8]}")
    group_of = _group_of_param(engine, stage, params)
    if stage == 0:
        pieces = _zero0_pieces(engine, layer_map, params, rank, world_size)
    elif stage in (1, 2):
        pieces = _zero12_pieces(engine.optimizer, layer_map, params, group_of)
    else:
        pieces = _zero3_pieces(engine.optimizer, layer_map, params, group_of)
    layers: dict[str, LayerLayout] = {}
    for layer in layer_map.layers:
        owned, needed, masters = pieces[layer.name]
        indices = sorted({group_of[p.name] for p in layer.params})
        layers[layer.name] = LayerLayout(
            name=layer.name,
            owned=owned,
            needed=needed,
            masters=masters,
            groups=tuple(optimizer.param_groups[i] for i in indices),
            group_params=tuple(tuple(p.name for p in layer.params if group_of[p.name] == i) for i in indices),
            group_indices=tuple(indices),
        )
        for master in masters:
            optim_state.init_state(optimizer, master)  # restore into a fresh engine needs moments to write into
    logger.info(
        "state layout: ZeRO-%d, rank %d of %d, %d layers over %d param groups (%s)",
        stage,
        rank,
        world_size,
        len(layers),
        len(optimizer.param_groups),
        type(optimizer).__name__,
    )
    return StateLayout(
        stage=stage,
        rank=rank,
        world_size=world_size,
        layers=layers,
        layer_map=layer_map,
        optimizer=optimizer,
        steps_taken=lambda: int(engine.global_steps),
        refresh=partial(_refresh, engine, stage, layers),
        kind="deepspeed",
    )


_Pieces = dict[str, tuple[tuple[Piece, ...], tuple[Piece, ...], tuple[torch.Tensor, ...]]]


def _group_of_param(engine: DeepSpeedEngine, stage: int, params: Mapping[str, torch.nn.Parameter]) -> dict[str, int]:
    """Per model parameter name, the index of the client param group that holds it."""
    if stage == 0:
        master_of = {id(lp): hp for lp, hp in ds_internals.zero0_master_pairs(engine)}
        index_of = {
            id(p): i for i, g in enumerate(ds_internals.client_optimizer(engine).param_groups) for p in g["params"]
        }
        return {name: index_of[id(master_of[id(p)])] for name, p in params.items() if id(p) in master_of}
    groups = (
        ds_internals.zero12_param_groups(engine.optimizer)
        if stage in (1, 2)
        else ds_internals.zero3_param_groups(engine.optimizer)
    )
    index_of = {id(p): i for i, group in enumerate(groups) for p in group}
    return {name: index_of[id(p)] for name, p in params.items() if id(p) in index_of}


def _unique(tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    seen: dict[int, torch.Tensor] = {}
    for t in tensors:
        seen.setdefault(id(t), t)
    return tuple(seen.values())


def _zero0_pieces(
    engine: DeepSpeedEngine, layer_map: LayerMap, params: Mapping[str, torch.nn.Parameter], rank: int, world_size: int
) -> _Pieces:
    master_of = {id(lp): hp for lp, hp in ds_internals.zero0_master_pairs(engine)}
    out: _Pieces = {}
    for layer in layer_map.layers:
        owned, needed = [], []
        for info in layer.params:
            master = master_of[id(params[info.name])]
            offset, length = zero0_owned_range(info.numel, rank, world_size)
            if length:
                owned.append(Piece(ParamSlice(info.name, info.shape, offset, length), master, offset))
            needed.append(Piece(ParamSlice(info.name, info.shape, 0, info.numel), master, 0))
        masters = _unique([p.master for p in needed])
        out[layer.name] = (tuple(owned), tuple(needed), masters)
    return out


def _zero12_pieces(
    zero_optimizer: DeepSpeedZeroOptimizer,
    layer_map: LayerMap,
    params: Mapping[str, torch.nn.Parameter],
    group_of: Mapping[str, int],
) -> _Pieces:
    flats = ds_internals.zero12_flat_partitions(zero_optimizer)  # one per param group, same order
    out: _Pieces = {}
    for layer in layer_map.layers:
        owned: list[Piece] = []
        for info in layer.params:
            fragment = ds_internals.zero12_fragment(params[info.name])
            if fragment is not None:
                owned.append(
                    Piece(
                        ParamSlice(info.name, info.shape, fragment.param_offset, fragment.length),
                        flats[fragment.flat_index],
                        fragment.flat_start,
                    )
                )
        masters = _unique([flats[i] for i in sorted({group_of[p.name] for p in layer.params})])
        out[layer.name] = (tuple(owned), tuple(owned), masters)
    return out


def _zero3_pieces(
    zero_optimizer: DeepSpeedZeroOptimizer_Stage3,
    layer_map: LayerMap,
    params: Mapping[str, torch.nn.Parameter],
    group_of: Mapping[str, int],
) -> _Pieces:
    flats = ds_internals.zero3_flat_partitions(zero_optimizer)  # one per sub-group
    group_of_sub = ds_internals.zero3_sub_group_to_group(zero_optimizer)
    out: _Pieces = {}
    for layer in layer_map.layers:
        owned: list[Piece] = []
        for info in layer.params:
            fragment = ds_internals.zero3_fragment(zero_optimizer, params[info.name])
            if fragment.length:
                owned.append(
                    Piece(
                        ParamSlice(info.name, info.shape, fragment.param_offset, fragment.length),
                        flats[fragment.flat_index],
                        fragment.flat_start,
                    )
                )
        mine = {group_of[p.name] for p in layer.params}
        masters = _unique([flats[s] for s, g in sorted(group_of_sub.items()) if g in mine])
        out[layer.name] = (tuple(owned), tuple(owned), masters)
    return out


def _refresh(engine: DeepSpeedEngine, stage: int, layers: Mapping[str, LayerLayout], restored: Sequence[str]) -> None:
    """Make the forward read the fp32 masters just written for ``restored``: collective at ZeRO
    1-3 (every rank calls it, with any layers); ZeRO-0 copies only the restored layers' parameters."""
    if stage == 0:
        wanted = {id(p.master) for name in restored for p in layers[name].needed}
        ds_internals.zero0_refresh_lp(
            [(lp, hp) for lp, hp in ds_internals.zero0_master_pairs(engine) if id(hp) in wanted]
        )
    elif stage in (1, 2):
        ds_internals.zero12_refresh_lp(engine.optimizer)
    else:
        ds_internals.zero3_refresh_lp(engine.optimizer)


def join_group(store: torch.distributed.Store | None) -> None:
    """Form torch's default group (:func:`layercheck.workers.env.form_group`) and DeepSpeed's
    communication backend over it.

    A process that left an earlier group (an in-place recovery's survivor) keeps DeepSpeed's
    backend object, which reads the group from torch.distributed on every call: it forms only
    torch's group. DeepSpeed's inference-only CPU communication op is never built
    (:func:`ds_internals.skip_inference_comm_op`), also where torch's group was formed before (by
    Ray Train) and ``deepspeed.initialize`` starts DeepSpeed's backend."""
    ds_internals.skip_inference_comm_op()  # before DeepSpeed's backend starts, even over a group Ray Train formed
    if torch.distributed.is_initialized():
        return
    from deepspeed import comm

    fresh = comm.cdb is None
    if fresh:
        env.check_build_locks()
    if store is not None or not fresh:
        env.form_group(store)
    if fresh:  # DeepSpeed's backend object, over torch's group if formed above
        import deepspeed

        deepspeed.init_distributed(dist_backend=env.comm_backend(), auto_mpi_discovery=False)


def reset_for_next_engine() -> None:
    """After the process group is gone: DeepSpeed's references to it and its clones, ZeRO-3's id
    counters (:func:`ds_internals.reset_for_next_engine`)."""
    ds_internals.reset_for_next_engine()


def warm_imports() -> None:
    """Import DeepSpeed now, and the Muon optimizer its ZeRO optimizers import as they are built
    (:func:`ds_internals.import_muon_compiling_on_first_call`), and keep its inference-only CPU comm
    op from being JIT-built (:func:`ds_internals.skip_inference_comm_op`): before a user's
    ``deepspeed.initialize`` starts DeepSpeed's backend, and for a warm spare's wait."""
    env.set_accelerator()
    import deepspeed  # noqa: F401

    ds_internals.import_muon_compiling_on_first_call()
    ds_internals.skip_inference_comm_op()


def deepspeed_config(cfg: EngineConfig) -> dict[str, object]:
    """The DeepSpeed config dict for ``cfg``; ``cfg.extra_ds_config`` is merged last."""
    config: dict[str, object] = {
        "train_micro_batch_size_per_gpu": cfg.micro_batch,
        "gradient_accumulation_steps": cfg.grad_accum,
        "gradient_clipping": cfg.grad_clip,
        "zero_optimization": {"stage": cfg.zero_stage},
        "bf16": {"enabled": cfg.precision == "bf16"},
        # DriftAdamW subclasses AdamW; DeepSpeed checks the exact type, so allow it explicitly.
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }
    return _merge(config, cfg.extra_ds_config)


def _merge(base: dict[str, object], extra: Mapping[str, object]) -> dict[str, object]:
    out = dict(base)
    for key, value in extra.items():
        current = out.get(key)
        out[key] = _merge(current, value) if isinstance(value, Mapping) and isinstance(current, dict) else value
    return out


def build_deepspeed(
    model: torch.nn.Module,
    make_optimizer: Callable[[torch.nn.Module], torch.optim.Optimizer],
    make_scheduler: Callable[[torch.optim.Optimizer], LRScheduler],
    cfg: EngineConfig,
) -> DeepSpeedAdapter:
    """The built-in loop's ``DeepSpeedEngine`` for ``model`` (``deepspeed.initialize`` with the
    optimizer and scheduler made here, and :func:`deepspeed_config`), in the default group."""
    import deepspeed  # late: env.init_distributed sets the accelerator first

    ds_internals.check_deepspeed_version(deepspeed.__version__)
    ds_internals.import_muon_compiling_on_first_call()  # ~2 s of CPU less per engine build
    optimizer = make_optimizer(model)
    engine, _, _, _ = deepspeed.initialize(
        model=model, optimizer=optimizer, lr_scheduler=make_scheduler, config=deepspeed_config(cfg)
    )
    _undo_zero0_init_step(engine, optimizer)
    return DeepSpeedAdapter(engine)


def _undo_zero0_init_step(engine: DeepSpeedEngine, optimizer: torch.optim.Optimizer) -> None:
    """Undo the zero-gradient ``step()`` DeepSpeed's bf16 ZeRO-0 optimizer runs at init.

    ``FP16_UnfusedOptimizer.initialize_optimizer_states`` steps the client optimizer once to
    create its state: Adam's count becomes 1 and weight decay shrinks the fp32 masters, which
    then no longer match the model. Copy the masters back from the model and drop that state
    (the builder discards the drift it produced), so every stage starts from step 0 with the
    same weights.
    """
    pairs = (
        [(lp, hp) for lp, hp in ds_internals.zero0_master_pairs(engine) if lp is not hp]
        if engine.zero_optimization_stage() == 0
        else []
    )
    with torch.no_grad():
        for lp, hp in pairs:
            hp.copy_(lp.float())
            optimizer.state.pop(hp, None)
    if pairs:
        logger.info(
            "undid DeepSpeed's init-time optimizer step on %d fp32 masters (ZeRO-0 %s)",
            len(pairs),
            engine.optimizer.__class__.__name__,
        )
