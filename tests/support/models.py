"""The tests' one tiny model: a random-init Llama config (no downloads), the variants some tests
need (tied embeddings, four blocks, the SFT tokenizer's vocabulary), and the same sizes in the
other Hugging Face families the layer map knows."""

from __future__ import annotations

from typing import Any

import transformers

TINY_LLAMA: dict[str, Any] = {
    "model_type": "llama",
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "tie_word_embeddings": False,
}
SEQ = 16
"""The tokens per row the tests train on."""


def tiny_llama(**overrides: Any) -> dict[str, Any]:
    """``TINY_LLAMA`` with some fields changed (a new dict)."""
    return {**TINY_LLAMA, **overrides}


TIED_LLAMA = tiny_llama(tie_word_embeddings=True)
"""Tied embeddings: the composite, export and capture tests (the head is the embedding)."""
FOUR_BLOCKS = tiny_llama(num_hidden_layers=4)
"""Room to freeze some blocks and train others (the freeze and layer-wise LR decay tests)."""
SFT_LLAMA = tiny_llama(vocab_size=512)
"""The vocabulary of examples/data/sft-tokenizer."""


def tiny_config(family: str, **overrides: Any) -> transformers.PretrainedConfig:
    """``TINY_LLAMA``'s sizes in the config class of ``family``."""
    sizes = {k: v for k, v in TINY_LLAMA.items() if k not in ("model_type", "tie_word_embeddings")}
    vocab, hidden, layers, heads = (
        sizes[k] for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")
    )
    positions = sizes["max_position_embeddings"]
    if family == "llama":
        return transformers.LlamaConfig(**{**sizes, **overrides})
    if family == "mistral":
        return transformers.MistralConfig(**{**sizes, **overrides})
    if family == "qwen2":
        return transformers.Qwen2Config(**{**sizes, "tie_word_embeddings": True, **overrides})
    if family == "gpt2":
        return transformers.GPT2Config(
            **{
                "vocab_size": vocab,
                "n_embd": hidden,
                "n_layer": layers,
                "n_head": heads,
                "n_positions": positions,
                "bos_token_id": 0,
                "eos_token_id": 0,
                **overrides,
            }
        )
    if family == "gpt_neox":
        return transformers.GPTNeoXConfig(**{**sizes, **overrides})
    if family == "opt":
        return transformers.OPTConfig(
            **{
                "vocab_size": vocab,
                "hidden_size": hidden,
                "ffn_dim": sizes["intermediate_size"],
                "num_hidden_layers": layers,
                "num_attention_heads": heads,
                "word_embed_proj_dim": hidden,
                "max_position_embeddings": positions,
                **overrides,
            }
        )
    if family == "falcon":
        return transformers.FalconConfig(
            **{
                "vocab_size": vocab,
                "hidden_size": hidden,
                "num_hidden_layers": layers,
                "num_attention_heads": heads,
                **overrides,
            }
        )
    if family == "phi":
        return transformers.PhiConfig(**{**sizes, "num_key_value_heads": heads, **overrides})
    raise ValueError(family)


def tiny_model(family: str, **overrides: Any) -> transformers.PreTrainedModel:
    return transformers.AutoModelForCausalLM.from_config(tiny_config(family, **overrides))
