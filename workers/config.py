"""Typed, validated configuration of one worker's training engine.

Three small frozen dataclasses, one per concern: which model (``ModelConfig``), how the
optimizer and its learning-rate schedule behave (``OptimConfig``) and which engine runs it and how
(``EngineConfig``). Every bad value raises at construction with a message naming the field,
so a typo in a run file fails on the driver, not half-way through a distributed start.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from layercheck.policies.config_loader import ConfigError, require, require_finite

logger = logging.getLogger(__name__)

Schedule = Literal["cosine", "linear", "constant"]
Precision = Literal["fp32", "bf16"]
Backend = Literal["deepspeed", "fsdp2"]

SCHEDULES: tuple[str, ...] = ("cosine", "linear", "constant")
#: How DriftAdamW computes a measured step: ``foreach`` (torch's step, then the L1 of what it moved),
#: ``fused`` (the L1 counted inside the update), or ``auto`` (the cheapest by the committed benchmark
#: figures on the parameters' device: :mod:`layercheck.workers.drift.choice`; ``foreach`` on CPU and CUDA today).
DRIFT_STEPS: tuple[str, ...] = ("auto", "foreach", "fused")
PRECISIONS: tuple[str, ...] = ("fp32", "bf16")
ZERO_STAGES: tuple[int, ...] = (0, 1, 2, 3)
BACKENDS: tuple[str, ...] = ("deepspeed", "fsdp2")


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Which causal LM to train: a Hugging Face config (random init) or a local checkpoint."""

    hf_config: Mapping[str, Any] | None = None
    """A ``transformers`` config as a dict with ``model_type`` (e.g. ``{"model_type": "llama", ...}``)."""
    path: str | None = None
    """A local directory that ``AutoModelForCausalLM.from_pretrained`` can read (no downloads)."""
    seed: int = 0
    """Seeds the random initialisation, so every rank builds the same starting weights."""
    freeze: tuple[str, ...] = ()
    """Layers to freeze: names or glob patterns over LayerCheck's layer names (``embed``,
    ``block.N``, ``norm``, ``lm_head``; e.g. ``["embed", "block.[0-5]"]``). A frozen layer's
    parameters get ``requires_grad=False`` and no optimizer state; LayerCheck never persists it
    and recovery keeps the model's own weights for it (exact: it never changes). Each pattern
    must match a layer, and at least one layer must stay trainable."""

    def __post_init__(self) -> None:
        if (self.hf_config is None) == (self.path is None):
            raise ConfigError("hf_config / path: give exactly one of the two")
        if self.hf_config is not None:
            require("model_type" in self.hf_config, "hf_config", "a dict with 'model_type'", self.hf_config)
        require(self.seed >= 0, "seed", "a non-negative integer", self.seed)
        require(
            isinstance(self.freeze, tuple) and all(isinstance(p, str) and p.strip() for p in self.freeze),
            "freeze",
            "a list of non-empty layer names or glob patterns",
            self.freeze,
        )


@dataclass(frozen=True, kw_only=True)
class OptimConfig:
    """AdamW and its learning-rate schedule (linear warm-up, then decay to ``min_lr_ratio``)."""

    lr: float = 1e-5
    """Peak learning rate, reached at the end of warm-up."""
    betas: tuple[float, float] = (0.9, 0.999)
    """Adam's decay rates of the first and second moments."""
    eps: float = 1e-8
    """Adam's denominator term."""
    weight_decay: float = 0.0
    """Applied to matrices only; biases, norms and other vectors get 0 (see the layer map)."""
    warmup_steps: int = 0
    """Steps of linear warm-up from ``lr / warmup_steps`` to ``lr``."""
    total_steps: int = 1000
    """The step at which decay ends; later steps keep the final learning rate."""
    min_lr_ratio: float = 0.0
    """The final learning rate as a fraction of ``lr``."""
    schedule: Schedule = "cosine"
    """Decay after warm-up: ``cosine``, ``linear`` or ``constant``."""
    layer_lr_decay: float = 1.0
    """Layer-wise learning-rate decay ``d`` in (0, 1]: with B blocks, ``block.i`` trains at
    ``lr * d**(B - 1 - i)`` (the last block at ``lr``), ``embed`` at ``lr * d**B`` (the lowest),
    ``norm`` and ``lm_head`` at ``lr``; the schedule scales every layer alike. 1 (the default)
    gives every layer ``lr``."""
    drift_step: Literal["auto", "foreach", "fused"] = "auto"
    """How the optimizer measures each layer's drift on the steps it measures: ``foreach``
    (torch's own AdamW step, its fused kernel on CPU and CUDA, with the owned elements copied before
    and diffed after: snapshot-and-diff), ``fused`` (counted inside the update: no copy, no second
    pass; a Triton kernel on CUDA where Triton imports, cache-sized chunks elsewhere, in the
    arithmetic order of ``torch.optim.AdamW(foreach=False)``), or ``auto``: the one with the lowest
    committed cost per step on the parameters' device (``layercheck.workers.drift.choice``;
    ``foreach`` on CPU and CUDA today). Both give the same drift; the steps not measured are torch's
    own AdamW step either way (fused on CPU and CUDA; foreach beside ``fused`` on CUDA, whose
    Triton step reads the step counts on the host)."""

    def __post_init__(self) -> None:
        require_finite(self)
        require(math.isfinite(self.lr) and self.lr > 0, "lr", "a positive finite number", self.lr)
        require(
            len(self.betas) == 2 and all(0.0 <= b < 1.0 for b in self.betas),
            "betas",
            "two numbers in [0, 1)",
            self.betas,
        )
        require(self.eps > 0, "eps", "positive", self.eps)
        require(self.weight_decay >= 0, "weight_decay", "non-negative", self.weight_decay)
        require(self.warmup_steps >= 0, "warmup_steps", "non-negative", self.warmup_steps)
        require(
            self.total_steps >= self.warmup_steps,
            "total_steps",
            f"at least warmup_steps ({self.warmup_steps})",
            self.total_steps,
        )
        require(0.0 <= self.min_lr_ratio <= 1.0, "min_lr_ratio", "in [0, 1]", self.min_lr_ratio)
        require(self.schedule in SCHEDULES, "schedule", f"one of {SCHEDULES}", self.schedule)
        require(self.drift_step in DRIFT_STEPS, "drift_step", f"one of {DRIFT_STEPS}", self.drift_step)
        require(0.0 < self.layer_lr_decay <= 1.0, "layer_lr_decay", "in (0, 1] (1 = no decay)", self.layer_lr_decay)
        if self.schedule == "constant" and self.min_lr_ratio not in (0.0, 1.0):
            logger.warning("OptimConfig.min_lr_ratio=%s has no effect with schedule='constant'", self.min_lr_ratio)


_UNSET = object()


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """Which engine runs the model and how: DeepSpeed's ZeRO stage or FSDP2, precision, batch
    shape and clipping."""

    backend: Backend = "deepspeed"
    """``deepspeed`` (ZeRO ``zero_stage``) or ``fsdp2`` (PyTorch's ``fully_shard`` on each decoder
    layer and the root over a 1-D mesh of all ranks; bf16 through FSDP's ``MixedPrecisionPolicy``
    over fp32 sharded masters)."""
    zero_stage: int = 0
    """DeepSpeed ZeRO stage, 0-3 (3 shards weights, gradients and optimizer state); with
    ``backend = "fsdp2"`` unset or 3 (FSDP2 always shards like ZeRO-3)."""
    precision: Precision = "fp32"
    """Model compute dtype; optimizer master weights and moments are fp32 in both cases."""
    micro_batch: int = 1
    """Sequences per rank per forward/backward."""
    grad_accum: int = 1
    """Micro-batches per optimizer step."""
    grad_clip: float = 0.0
    """Global gradient-norm clip; 0 disables clipping."""
    extra_ds_config: Mapping[str, Any] = field(default_factory=dict)
    """Merged last into the generated DeepSpeed config, for settings this class does not model."""

    def __post_init__(self) -> None:
        require_finite(self)
        require(self.backend in BACKENDS, "backend", f"one of {BACKENDS}", self.backend)
        if self.backend == "fsdp2":
            # FSDP2 shards weights, gradients and optimizer state as ZeRO-3 does: 3 says so, 0 is the default
            require(self.zero_stage in (0, 3), "zero_stage", 'unset or 3 with backend = "fsdp2"', self.zero_stage)
            require(
                not self.extra_ds_config, "extra_ds_config", 'empty with backend = "fsdp2"', dict(self.extra_ds_config)
            )
        require(self.zero_stage in ZERO_STAGES, "zero_stage", f"one of {ZERO_STAGES}", self.zero_stage)
        require(self.precision in PRECISIONS, "precision", f"one of {PRECISIONS}", self.precision)
        require(self.micro_batch >= 1, "micro_batch", "at least 1", self.micro_batch)
        require(self.grad_accum >= 1, "grad_accum", "at least 1", self.grad_accum)
        require(self.grad_clip >= 0, "grad_clip", "non-negative (0 = off)", self.grad_clip)
        self._check_extra()

    def _check_extra(self) -> None:
        """``extra_ds_config`` may add what this class does not model, never contradict what it
        does: a ``zero_optimization.stage`` there silently won over ``zero_stage``."""
        extra = self.extra_ds_config
        modelled = {
            ("zero_optimization", "stage"): ("zero_stage", self.zero_stage),
            ("train_micro_batch_size_per_gpu",): ("micro_batch", self.micro_batch),
            ("gradient_accumulation_steps",): ("grad_accum", self.grad_accum),
            ("gradient_clipping",): ("grad_clip", self.grad_clip),
            ("bf16", "enabled"): ("precision", self.precision == "bf16"),
        }
        for path, (name, ours) in modelled.items():
            value: Any = extra
            for key in path:
                value = value.get(key, _UNSET) if isinstance(value, Mapping) else _UNSET
            if value is not _UNSET and value != ours:
                raise ConfigError(
                    f"extra_ds_config.{'.'.join(path)}: {value!r} contradicts {name} "
                    f"({getattr(self, name)!r}); set {name} instead"
                )
