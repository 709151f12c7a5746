"""Layer tables of real models (the shapes the harness's synthetic shards take), from their
published configs: per layer the element count, in model order (``embed``, ``block.0`` …, ``norm``,
``lm_head``). The harness divides every count by a scale factor so that N ranks' shards fit one
machine's memory; the sizing arithmetic (``bench/scale/sizing.py``) uses them unscaled."""

from __future__ import annotations

from dataclasses import dataclass

from layercheck.policies.layer_map import EMBED, LM_HEAD, NORM, block_name


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    """A decoder-only transformer's trainable shapes (Llama / Qwen2 layout)."""

    name: str
    hidden: int
    intermediate: int
    blocks: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool = False
    qkv_bias: bool = False

    def block_numel(self) -> int:
        q = self.heads * self.head_dim
        kv = self.kv_heads * self.head_dim
        attention = self.hidden * q + 2 * self.hidden * kv + q * self.hidden
        bias = (q + 2 * kv) if self.qkv_bias else 0
        mlp = 3 * self.hidden * self.intermediate
        norms = 2 * self.hidden
        return attention + bias + mlp + norms

    def layer_numel(self) -> dict[str, int]:
        """Per layer, its trainable elements, in model order (a tied head is no layer of its own)."""
        layers = {EMBED: self.vocab * self.hidden}
        layers.update({block_name(i): self.block_numel() for i in range(self.blocks)})
        layers[NORM] = self.hidden
        if not self.tied:
            layers[LM_HEAD] = self.vocab * self.hidden
        return layers

    @property
    def numel(self) -> int:
        return sum(self.layer_numel().values())


#: Qwen2.5-7B (``Qwen/Qwen2.5-7B`` config.json): 28 blocks, untied head, biased q/k/v: 31 layers, 7.62e9 elements.
QWEN25_7B = ModelShape(
    name="qwen2.5-7b",
    hidden=3584,
    intermediate=18944,
    blocks=28,
    heads=28,
    kv_heads=4,
    head_dim=128,
    vocab=152064,
    qkv_bias=True,
)
#: Llama-3.1-70B (``meta-llama/Llama-3.1-70B`` config.json): 80 blocks, untied head: 83 layers, 7.06e10 elements.
LLAMA31_70B = ModelShape(
    name="llama3.1-70b",
    hidden=8192,
    intermediate=28672,
    blocks=80,
    heads=64,
    kv_heads=8,
    head_dim=128,
    vocab=128256,
)

SHAPES: dict[str, ModelShape] = {s.name: s for s in (QWEN25_7B, LLAMA31_70B)}


def scaled_numel(shape: ModelShape, scale: int) -> dict[str, int]:
    """``shape``'s layer table with every count divided by ``scale`` (at least one element each)."""
    if scale < 1:
        raise ValueError(f"scale must be >= 1, got {scale}")
    return {name: max(1, numel // scale) for name, numel in shape.layer_numel().items()}
