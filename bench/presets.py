"""Workloads the benchmark trains: the CPU default and GPU presets of real model shapes.

A workload is plain data (JSON round-trip) so it travels to the spawned ranks unchanged.
The CPU default is the demo's tiny Llama (``examples/demo.toml``: model, data, optimiser and
engine as the demo has them), run longer with two fixed failures. The GPU presets are
Qwen2.5-0.5B / 1.5B shapes built from config (random init), bf16, ZeRO-3 on NCCL.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from layercheck.bench.strategies import StrategyOptions
from layercheck.workers.config import BACKENDS, Backend, Precision

DEMO_LLAMA: dict[str, Any] = {
    "model_type": "llama",
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
}

QWEN25_05B: dict[str, Any] = {
    "model_type": "qwen2",
    "vocab_size": 151936,
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": True,
}

QWEN25_15B: dict[str, Any] = {
    "model_type": "qwen2",
    "vocab_size": 151936,
    "hidden_size": 1536,
    "intermediate_size": 8960,
    "num_hidden_layers": 28,
    "num_attention_heads": 12,
    "num_key_value_heads": 2,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": True,
}


@dataclass(frozen=True, kw_only=True)
class Workload:
    name: str
    model: Mapping[str, Any]
    """A ``transformers`` config dict with ``model_type`` (random init, seed 0)."""
    steps: int
    failures: tuple[int, ...]
    """Steps after which a rank fails (same for every strategy)."""
    seq_len: int = 64
    micro_batch: int = 4
    lr: float = 1e-3
    lr_warmup: int = 10
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    engine: Backend = "deepspeed"
    """The engine every strategy trains on: ``deepspeed`` (ZeRO ``zero_stage``) or ``fsdp2``
    (``fully_shard``; the full-checkpoint baselines are then DCP's, ``layercheck bench --engine``)."""
    zero_stage: int = 3
    """DeepSpeed's ZeRO stage (FSDP2 shards as ZeRO-3 does: 3, or 0 read as unset)."""
    precision: Precision = "fp32"
    world_size: int = 2
    device: str = "cpu"
    """``cpu`` (gloo) or ``cuda`` (NCCL, one GPU per rank)."""
    tokenizer_vocab: int = 256
    """Byte-level corpus tokens (< 256) are valid ids in any larger vocabulary."""
    freeze: tuple[str, ...] = ()
    """``model.freeze``: layers (names or glob patterns) trained with ``requires_grad=False``."""
    layer_lr_decay: float = 1.0
    """``optim.layer_lr_decay``: lr of ``block.i`` = lr * d**(B-1-i), embed lr * d**B."""
    strategy: StrategyOptions = field(default_factory=StrategyOptions)

    def __post_init__(self) -> None:
        if self.steps < 2:
            raise ValueError(f"Workload.steps: must be >= 2, got {self.steps}")
        if self.engine not in BACKENDS:
            raise ValueError(f"Workload.engine: one of {BACKENDS}, got {self.engine!r}")
        if self.engine == "fsdp2" and self.zero_stage not in (0, 3):
            raise ValueError(
                f"Workload.zero_stage: FSDP2 shards like ZeRO-3 (3, or 0 for unset), got {self.zero_stage}"
            )
        if any(not 1 <= f < self.steps for f in self.failures) or list(self.failures) != sorted(set(self.failures)):
            raise ValueError(f"Workload.failures: increasing steps in [1, {self.steps}), got {self.failures}")
        if not 0 <= self.lr_warmup <= self.steps:
            raise ValueError(f"Workload.lr_warmup: must be in [0, steps={self.steps}], got {self.lr_warmup}")
        if self.strategy.layercheck_warmup >= (self.failures[0] if self.failures else self.steps):
            raise ValueError("Workload.strategy.layercheck_warmup: must come before the first failure")

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["failures"] = list(self.failures)
        out["freeze"] = list(self.freeze)
        out["model"] = dict(self.model)
        out["strategy"] = {**asdict(self.strategy), "layercheck": dict(self.strategy.layercheck)}
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Workload:
        fields = dict(data)
        fields["failures"] = tuple(fields["failures"])
        fields["freeze"] = tuple(fields.get("freeze", ()))
        fields["strategy"] = StrategyOptions(**fields["strategy"])
        return cls(**fields)


PRESETS: dict[str, Workload] = {
    # ~0.1M params, ~0.05-0.2 s a step on 2 CPU cores: the whole run takes a few minutes.
    "tiny": Workload(
        name="tiny",
        model=DEMO_LLAMA,
        steps=200,
        failures=(110, 170),
        strategy=StrategyOptions(interval=50, layercheck_warmup=40),
    ),
    # GPU presets: one rank per GPU; one by default (the project's GPU machine has one H200;
    # --world-size 2 or more on a machine with that many GPUs). Shorter runs: a full checkpoint
    # of the 0.5B shape is ~6 GB, and the whole command must finish in 8 minutes.
    "qwen2.5-0.5b": Workload(
        name="qwen2.5-0.5b",
        model=QWEN25_05B,
        steps=60,
        failures=(33, 51),
        seq_len=1024,
        micro_batch=4,
        lr=1e-5,
        lr_warmup=6,
        precision="bf16",
        device="cuda",
        world_size=1,
        strategy=StrategyOptions(interval=15, layercheck_warmup=12, min_matched_interval=5),
    ),
    # 1.5B: a full checkpoint is ~18.5 GB of fp32 state; intervals keep one run's files under ~60 GB.
    "qwen2.5-1.5b": Workload(
        name="qwen2.5-1.5b",
        model=QWEN25_15B,
        steps=40,
        failures=(22, 34),
        seq_len=1024,
        micro_batch=2,
        lr=1e-5,
        lr_warmup=4,
        precision="bf16",
        device="cuda",
        world_size=1,
        strategy=StrategyOptions(interval=20, layercheck_warmup=8, min_matched_interval=20),
    ),
}


#: Workload variants where layers differ (``--workload``): the layers trained, or their pace.
VARIANTS: tuple[str, ...] = ("default", "frozen-half", "lr-decay-0.8")


def variant(w: Workload, name: str) -> Workload:
    """``w`` as variant ``name``: ``frozen-half`` freezes the first half of the blocks (as
    post-training that keeps the lower layers does), ``lr-decay-0.8`` trains block i at
    lr * 0.8**(B-1-i) (layer-wise LR decay). ``default`` is ``w`` itself."""
    if name not in VARIANTS:
        raise ValueError(f"unknown workload variant {name!r}; known: {list(VARIANTS)}")
    if name == "default":
        return w
    if name == "frozen-half":
        half = int(w.model["num_hidden_layers"]) // 2
        return replace(w, name=f"{w.name}+{name}", freeze=tuple(f"block.{i}" for i in range(half)))
    return replace(w, name=f"{w.name}+{name}", layer_lr_decay=0.8)


def preset(name: str, **overrides: Any) -> Workload:
    """The named preset with ``overrides`` (``None`` values ignored)."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; known: {sorted(PRESETS)}")
    base = PRESETS[name]
    strategy_keys = {"interval", "layercheck_warmup", "delta_density", "memory_period"}
    strat = {k: v for k, v in overrides.items() if k in strategy_keys and v is not None}
    rest = {k: v for k, v in overrides.items() if k not in strategy_keys and v is not None}
    if strat:
        rest["strategy"] = replace(base.strategy, **strat)
    return replace(base, **rest)
