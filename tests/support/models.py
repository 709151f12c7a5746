"""Tiny Hugging Face causal LMs built from configs (no downloads), shared by the tests."""

from __future__ import annotations

import transformers

TINY = dict(
    vocab_size=256,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)


def tiny_config(family: str, **overrides) -> transformers.PretrainedConfig:
    if family == "llama":
        return transformers.LlamaConfig(**{**TINY, **overrides})
    if family == "mistral":
        return transformers.MistralConfig(**{**TINY, **overrides})
    if family == "qwen2":
        return transformers.Qwen2Config(**{**TINY, "tie_word_embeddings": True, **overrides})
    if family == "gpt2":
        return transformers.GPT2Config(
            **{
                "vocab_size": 256,
                "n_embd": 32,
                "n_layer": 2,
                "n_head": 4,
                "n_positions": 64,
                "bos_token_id": 0,
                "eos_token_id": 0,
                **overrides,
            }
        )
    if family == "gpt_neox":
        return transformers.GPTNeoXConfig(**{**TINY, **overrides})
    if family == "opt":
        return transformers.OPTConfig(
            **{
                "vocab_size": 256,
                "hidden_size": 32,
                "ffn_dim": 64,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "word_embed_proj_dim": 32,
                "max_position_embeddings": 64,
                **overrides,
            }
        )
    if family == "falcon":
        return transformers.FalconConfig(
            **{"vocab_size": 256, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, **overrides}
        )
    if family == "phi":
        return transformers.PhiConfig(**{**TINY, "num_key_value_heads": 4, **overrides})
    raise ValueError(family)


def tiny_model(family: str, **overrides):
    return transformers.AutoModelForCausalLM.from_config(tiny_config(family, **overrides))
