"""What LayerCheck needs of a training engine: one small protocol, two implementations.

:class:`~layercheck.workers.engines.deepspeed.DeepSpeedAdapter` (ZeRO 0-3) and
:class:`~layercheck.workers.engines.fsdp2.FSDP2Adapter` (``fully_shard`` over a 1-D mesh) are the
only modules that import DeepSpeed's or FSDP's internals (``tests/repo/test_layering.py``). The rest
of LayerCheck reads an engine through :class:`TrainingEngine` and the
:class:`~layercheck.workers.layout.StateLayout` it builds: the policy, the store, the recovery plan,
the supervisor and the runtime never learn which engine ran, except by its :attr:`~TrainingEngine.kind`
in the metrics and the summary.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal, Protocol, runtime_checkable

import torch

from layercheck.policies.layer_map import LayerMap
from layercheck.workers.data.batch import MicroBatch
from layercheck.workers.layout import StateLayout

#: The engines LayerCheck speaks (``[engine] backend``, the summary's ``engine``).
EngineKind = Literal["deepspeed", "fsdp2"]
ENGINE_KINDS: tuple[EngineKind, ...] = ("deepspeed", "fsdp2")


@runtime_checkable
class TrainingEngine(Protocol):
    """One rank's training engine, as LayerCheck sees it."""

    @property
    def kind(self) -> EngineKind:
        """Which engine it is, for the logs, the metrics and the summary."""

    @property
    def native(self) -> Any:
        """The engine's own object: the ``DeepSpeedEngine``, or the ``fully_shard`` model."""

    @property
    def module(self) -> torch.nn.Module:
        """The model whose ``named_parameters`` the layer map reads (no engine wrapper around it)."""

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The client optimizer: the one whose ``param_groups`` and Adam state hold the masters."""

    def describe(self) -> str:
        """A few words for the logs and the summary (``ZeRO-3``, ``FSDP2 over 4 ranks``)."""

    def build_layout(self, layer_map: LayerMap) -> StateLayout:
        """Map every layer of ``layer_map`` onto this rank's slices of the engine's state."""

    def steps_taken(self) -> int:
        """Optimizer steps taken so far (the step ``after_step`` must be called with)."""

    def current_lr(self) -> float:
        """The learning rate the next optimizer step will use (the first param group's)."""

    def seek(self, step: int) -> None:
        """Continue as if ``step`` optimizer steps had been taken: the engine's counters and its
        learning-rate scheduler. Weights and moments are not touched (a restore writes those)."""

    def train_step(self, micro_batches: Sequence[MicroBatch]) -> float:
        """One optimizer step over ``micro_batches`` (gradient accumulation, clipping, the
        scheduler): the built-in loop's step. Returns the mean loss."""

    def eval_loss(self, micro_batch: MicroBatch) -> float:
        """The loss of ``micro_batch`` without a step."""

    def release(self) -> None:
        """Free what the engine holds before the process leaves its group (best effort after a
        peer's loss: the group may be gone). The process may build another engine afterwards."""
