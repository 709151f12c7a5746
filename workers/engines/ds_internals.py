"""Every use of DeepSpeed's private API, each in one small function.

LayerCheck needs to see where each parameter's fp32 master elements and Adam moments live
inside DeepSpeed's optimizer wrappers, and to make restored master weights reach the forward.
DeepSpeed has no public API for either at ZeRO 1/2 or for the low-precision copy at ZeRO 3.
Each function here touches one private attribute or method, checks it exists, and raises
:class:`DeepSpeedInternalsError` naming it when it does not — so a DeepSpeed upgrade breaks here,
loudly, and ``tests/workers/test_worker_ds_internals.py`` says which piece moved.

A moved attribute is the easy case; a private attribute that keeps its name but changes meaning
(an offset counted differently, a partition laid out anew) would corrupt checkpoints silently.
So the engine builder refuses a DeepSpeed release outside :data:`VERIFIED_DEEPSPEED` (see
:func:`check_deepspeed_version`) unless the user opts in to trying one.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from layercheck.workers.engines import ALLOW_UNVERIFIED_ENV

if TYPE_CHECKING:
    from deepspeed import DeepSpeedEngine
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

logger = logging.getLogger(__name__)

#: The DeepSpeed releases every function here was verified against (``pyproject.toml`` pins the
#: same range; ``tests/workers/test_worker_ds_internals.py`` fails when the installed one is outside it).
VERIFIED_DEEPSPEED = ">=0.19.8,<0.20"


class DeepSpeedInternalsError(RuntimeError):
    """A private DeepSpeed attribute LayerCheck relies on is missing or changed shape, or the
    installed DeepSpeed is one they were not verified against."""


def deepspeed_is_verified(version: str) -> bool:
    """Whether DeepSpeed ``version`` is in :data:`VERIFIED_DEEPSPEED` (pre-releases are not)."""
    try:
        return SpecifierSet(VERIFIED_DEEPSPEED).contains(Version(version), prereleases=False)
    except InvalidVersion:
        return False


def check_deepspeed_version(version: str) -> None:
    """Refuse a DeepSpeed release outside the verified range before any engine is built: raise
    :class:`DeepSpeedInternalsError`, or, with ``LAYERCHECK_ALLOW_UNVERIFIED_DEEPSPEED=1``, log
    the same message as an error and go on."""
    if deepspeed_is_verified(version):
        return
    message = (
        f"DeepSpeed {version} is outside the range LayerCheck's use of its private API "
        f"(workers/engines/ds_internals.py) was verified against ({VERIFIED_DEEPSPEED}); install one "
        f"(pip install 'deepspeed{VERIFIED_DEEPSPEED}') or, to try this release, run "
        f"tests/workers/test_worker_ds_internals.py against it and set {ALLOW_UNVERIFIED_ENV}=1"
    )
    if os.environ.get(ALLOW_UNVERIFIED_ENV) == "1":
        logger.error("%s (going on: %s=1)", message, ALLOW_UNVERIFIED_ENV)
        return
    raise DeepSpeedInternalsError(message)


def _attr(obj: Any, name: str) -> Any:
    try:
        return getattr(obj, name)
    except AttributeError:
        raise DeepSpeedInternalsError(
            f"{type(obj).__name__} has no attribute {name!r}; DeepSpeed internals changed "
            f"(LayerCheck was verified with DeepSpeed {VERIFIED_DEEPSPEED}): update workers/engines/ds_internals.py"
        ) from None


@dataclass(frozen=True)
class Fragment:
    """Where one parameter's elements held by this rank sit in an fp32 flat partition.

    ``flat_index`` picks the flat partition (the param group at ZeRO 1/2, the sub-group at ZeRO 3),
    ``flat_start`` is the first element there, ``param_offset`` the first element in the
    flattened parameter, ``length`` how many elements.
    """

    flat_index: int
    flat_start: int
    param_offset: int
    length: int


def client_optimizer(engine: DeepSpeedEngine) -> torch.optim.Optimizer:
    """The optimizer object we passed to ``deepspeed.initialize`` (DeepSpeed wraps it)."""
    return _attr(engine, "basic_optimizer")


def zero0_master_pairs(engine: DeepSpeedEngine) -> list[tuple[torch.nn.Parameter, torch.Tensor]]:
    """ZeRO-0: (model parameter, its fp32 master) pairs. In fp32 they are the same tensor;
    in bf16 DeepSpeed's ``FP16_UnfusedOptimizer`` keeps full fp32 copies per group."""
    optimizer = engine.optimizer
    if optimizer is client_optimizer(engine):
        return [(p, p) for group in optimizer.param_groups for p in group["params"]]
    lp_groups = _attr(optimizer, "fp16_groups")
    hp_groups = _attr(optimizer, "fp32_groups")
    return [(lp, hp) for lps, hps in zip(lp_groups, hp_groups) for lp, hp in zip(lps, hps)]


def zero0_refresh_lp(pairs: list[tuple[torch.nn.Parameter, torch.Tensor]]) -> None:
    """ZeRO-0 bf16: copy restored fp32 masters into the model's low-precision parameters
    (what DeepSpeed itself does after each step). A no-op where they are the same tensor."""
    with torch.no_grad():
        for lp, hp in pairs:
            if lp is not hp:
                lp.data.copy_(hp.data)


def zero12_fragment(param: torch.nn.Parameter) -> Fragment | None:
    """ZeRO 1/2: this rank's fragment of ``param`` (``None`` when another rank holds all of it)."""
    mapping = _attr(param, "_hp_mapping")
    if mapping is None:
        return None
    hp, lp = _attr(mapping, "hp_fragment_address"), _attr(mapping, "lp_fragment_address")
    return Fragment(
        flat_index=int(_attr(mapping, "param_group_index")),
        flat_start=int(hp.start),
        param_offset=int(lp.start),
        length=int(hp.numel),
    )


def zero12_flat_partitions(zero_optimizer: DeepSpeedZeroOptimizer) -> list[torch.Tensor]:
    """ZeRO 1/2: this rank's fp32 flat partition of each param group (what the client optimizer steps)."""
    return list(_attr(zero_optimizer, "single_partition_of_fp32_groups"))


def zero12_param_groups(zero_optimizer: DeepSpeedZeroOptimizer) -> list[list[torch.nn.Parameter]]:
    """ZeRO 1/2: the model parameters of each client param group, in group order."""
    return [list(group) for group in _attr(zero_optimizer, "bit16_groups")]


def zero12_refresh_lp(zero_optimizer: DeepSpeedZeroOptimizer) -> None:
    """ZeRO 1/2: copy fp32 partitions into the low-precision params and all-gather them (collective)."""
    _attr(zero_optimizer, "update_lp_params")()


def zero3_fragment(zero_optimizer: DeepSpeedZeroOptimizer_Stage3, param: torch.nn.Parameter) -> Fragment:
    """ZeRO 3: where this rank's partition of ``param`` sits in its fp32 sub-group; ``length``
    excludes the padding DeepSpeed adds to make every parameter divisible by the world size."""
    positions = _attr(zero_optimizer, "grad_position")
    sub_group, flat_start, partition_numel = positions[_attr(zero_optimizer, "get_param_id")(param)]
    group = _attr(param, "ds_process_group")
    rank = torch.distributed.get_rank(group=group)
    offset = int(partition_numel) * rank
    length = max(0, min(int(partition_numel), int(_attr(param, "ds_numel")) - offset))
    return Fragment(flat_index=int(sub_group), flat_start=int(flat_start), param_offset=offset, length=length)


def zero3_flat_partitions(zero_optimizer: DeepSpeedZeroOptimizer_Stage3) -> list[torch.Tensor]:
    """ZeRO 3: this rank's fp32 flat partition of each sub-group."""
    return list(_attr(zero_optimizer, "fp32_partitioned_groups_flat"))


def zero3_sub_group_to_group(zero_optimizer: DeepSpeedZeroOptimizer_Stage3) -> dict[int, int]:
    """ZeRO 3: which client param group each fp32 sub-group belongs to."""
    return dict(_attr(zero_optimizer, "sub_group_to_group_id"))


def zero3_param_groups(zero_optimizer: DeepSpeedZeroOptimizer_Stage3) -> list[list[torch.nn.Parameter]]:
    """ZeRO 3: the model parameters of each client param group, in group order."""
    return [list(group) for group in _attr(zero_optimizer, "fp16_groups")]


def zero3_refresh_lp(zero_optimizer: DeepSpeedZeroOptimizer_Stage3) -> None:
    """ZeRO 3: push fp32 partitions into the low-precision partitions the forward gathers
    (collective). The prologue re-partitions parameters so the small *persistent* ones, kept
    gathered between steps, are refreshed too by the epilogue's all-gather."""
    _attr(zero_optimizer, "checkpoint_event_prologue")()
    reassign = _attr(zero_optimizer, "_reassign_or_swap_out_partitioned_parameters")
    for sub_group in range(len(zero3_flat_partitions(zero_optimizer))):
        reassign(sub_group)
    _attr(zero_optimizer, "checkpoint_event_epilogue")()


def reset_for_next_engine() -> None:
    """Make this process's next ``deepspeed.initialize`` number its parameters and modules as a
    fresh process would, once the previous engine is destroyed and the process group left.

    An in-place recovery builds a second engine in a survivor's process while the replacement
    builds its first: ZeRO-3 checks that every rank gave the same ids to the same parameters and
    modules (``assert_ints_same_as_other_ranks``), and two counters live on in the process —
    ``zero.Init.param_id`` (a class attribute) and the module counter of
    ``DeepSpeedZeRoOffload._register_deepspeed_module`` (a mutable default argument). And
    ``deepspeed.utils.groups`` keeps the groups it cloned from the old world group, which a new
    engine would otherwise use: they are released (what ``deepspeed.comm.destroy_process_group``
    does after a destroy that succeeded)."""
    from deepspeed.runtime.zero.parameter_offload import DeepSpeedZeRoOffload
    from deepspeed.runtime.zero.partition_parameters import Init
    from deepspeed.utils import groups

    _attr(groups, "_release_process_group_references")(None)

    for name in ("param_id", "num_persisted_parameters", "num_persisted_elements"):
        _attr(Init, name)
        setattr(Init, name, 0)
    defaults = _attr(DeepSpeedZeRoOffload._register_deepspeed_module, "__defaults__")
    if not (isinstance(defaults, tuple) and len(defaults) == 1 and isinstance(defaults[0], list)):
        raise DeepSpeedInternalsError(
            "DeepSpeedZeRoOffload._register_deepspeed_module no longer counts modules in a mutable default "
            f"(LayerCheck was verified with DeepSpeed {VERIFIED_DEEPSPEED}): update workers/engines/ds_internals.py"
        )
    defaults[0][:] = [0]


#: DeepSpeed's shared-memory communication op on its CPU accelerator (``ShareMemCommBuilder.NAME``).
SHM_COMM_OP = "deepspeed_shm_comm"


def skip_inference_comm_op() -> None:
    """Keep DeepSpeed's CPU communication backend from building its shared-memory op.

    ``deepspeed.comm.torch.TorchBackend`` loads the op for every process group it starts, and on
    a fresh machine (or a new virtual environment, whose torch paths key the build cache) that is
    a 30-40 s JIT build of C++, under a lock a killed build leaves behind for every later start
    to wait on. Only ``inference_all_reduce`` uses the op, and falls back to torch's all-reduce
    without it; training never calls it. ``build_shm_op`` skips an op that
    ``deepspeed.ops.__compatible_ops__`` marks incompatible. Call before the process's first
    ``deepspeed.init_distributed`` (``deepspeed.initialize`` calls it)."""
    import deepspeed.ops

    compatible = _attr(deepspeed.ops, "__compatible_ops__")
    if not isinstance(compatible, dict):
        raise DeepSpeedInternalsError(
            "deepspeed.ops.__compatible_ops__ is no longer a dict of op names "
            f"(LayerCheck was verified with DeepSpeed {VERIFIED_DEEPSPEED}): update workers/engines/ds_internals.py"
        )
    compatible[SHM_COMM_OP] = False


#: The module of DeepSpeed's Muon optimizer (DeepSpeed 0.19), which decorates its kernels with
#: ``torch.compile`` at import.
MUON_MODULE = "deepspeed.runtime.zero.muon.muon_optimizer"
_compile_patch = threading.Lock()


def import_muon_compiling_on_first_call() -> None:
    """Import DeepSpeed's Muon optimizer with its ``torch.compile`` decorations deferred to each
    function's first call.

    DeepSpeed 0.19 imports that module while it builds any ZeRO engine, whatever the optimizer:
    its sanity check and its ZeRO and bf16 optimizer wrappers each ask ``isinstance(optimizer,
    MuonWithAuxAdam)``. At import the module applies ``torch.compile`` to three functions, which
    imports torch's inductor: about 2 s of CPU in every process that builds an engine, on every
    worker start and on every replacement's path in a recovery, for an optimizer the run does not
    use. ``torch.compile`` compiles at a function's first call anyway; deferring the wrapping to
    that call too leaves the module as DeepSpeed wrote it (a Muon run compiles as before) and
    its import cheap. A no-op before DeepSpeed is imported (its import picks the accelerator: the
    caller's to make), once the module is imported, or on a DeepSpeed without it."""
    if "deepspeed" not in sys.modules or MUON_MODULE in sys.modules:
        return
    with _compile_patch:
        real = torch.compile
        torch.compile = compile_on_first_call(real)
        try:
            with contextlib.suppress(ImportError):
                __import__(MUON_MODULE)
        finally:
            torch.compile = real


def compile_on_first_call(compile_fn: Callable[..., Any]) -> Callable[..., Any]:
    """``torch.compile``'s calling forms (``compile(fn, **options)`` and the decorator
    ``compile(**options)``) with ``compile_fn(fn, **options)`` called at ``fn``'s first call.
    Called inside a function being compiled, ``fn`` runs as it is, for the compiler to trace
    (what it does with a compiled function called there)."""

    def deferred(model: Any = None, **options: Any) -> Any:
        if model is None:
            return functools.partial(deferred, **options)
        compiled: Callable[..., Any] | None = None

        @functools.wraps(model)
        def call(*args: Any, **kwargs: Any) -> Any:
            nonlocal compiled
            if torch.compiler.is_compiling():
                return model(*args, **kwargs)
            if compiled is None:
                compiled = compile_fn(model, **options)
            return compiled(*args, **kwargs)

        return call

    return deferred
