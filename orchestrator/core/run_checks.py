"""A run config checked against what it names, on the driver before any worker starts: the data
(read and tokenized) and the model (its layer map built without weights). Each failure is a
:class:`ConfigError` naming the field; torch and transformers are imported only here, when a run
starts, not where a config is merely read."""

from __future__ import annotations

import os

from layercheck.orchestrator.core.run_config import RunConfig
from layercheck.policies.config_loader import ConfigError, require
from layercheck.policies.layer_map import LayerMap
from layercheck.workers.config import ModelConfig
from layercheck.workers.data.config import DataSummary


def check_data(config: RunConfig) -> DataSummary:
    """Read and check the run's data on the driver, before any worker starts: a malformed JSONL
    line, a missing chat template, an empty data set, a ``seq_len`` no example fits in, or a
    tokenizer larger than the model's vocabulary raises :class:`ConfigError`."""
    from layercheck.workers.data.dataset import load_data  # torch: only where the data is checked

    _, summary = load_data(config.data)
    vocab = _model_vocab_size(config)
    require(
        vocab is None or summary.vocab_size <= vocab,
        "model.hf_config.vocab_size" if config.model.hf_config else "model.path",
        f">= the tokenizer's vocabulary ({summary.vocab_size}, data.tokenizer = {config.data.tokenizer!r})",
        vocab,
    )
    return summary


def check_model(model: ModelConfig) -> LayerMap:
    """Build the model's layer map on the driver (no weights allocated), turning what would be a
    traceback in every worker into a :class:`ConfigError` naming the field: a ``model.path`` that
    is not a local checkpoint folder, an unknown ``model.hf_config.model_type``, a config
    ``transformers`` refuses, a model LayerCheck cannot map into layers."""
    field = "model.path" if model.path is not None else "model.hf_config"
    if model.path is not None:
        if not os.path.isdir(model.path):
            raise ConfigError(
                f"model.path: no directory {model.path!r} (a local checkpoint folder with "
                "config.json; LayerCheck downloads nothing)"
            )
        if not os.path.isfile(os.path.join(model.path, "config.json")):
            raise ConfigError(f"model.path: {model.path!r} has no config.json; is it a Hugging Face model folder?")
    else:
        from transformers import CONFIG_MAPPING

        model_type = (model.hf_config or {}).get("model_type")
        if model_type not in CONFIG_MAPPING:
            raise ConfigError(
                f"model.hf_config.model_type: unknown model type {model_type!r}; transformers "
                "knows e.g. llama, qwen2, mistral, gpt2 (see transformers.CONFIG_MAPPING)"
            )
        field = "model.hf_config"
    from layercheck.workers.engine import layer_map_for  # torch and transformers: only when a run starts

    try:
        return layer_map_for(model)
    except Exception as error:  # transformers' own message, under the field that caused it
        raise ConfigError(f"{field}: cannot build the model: {type(error).__name__}: {error}") from None


def _model_vocab_size(config: RunConfig) -> int | None:
    if config.model.hf_config is not None:
        vocab = config.model.hf_config.get("vocab_size")
        return int(vocab) if isinstance(vocab, int) else None
    from transformers import AutoConfig  # a local checkpoint's config.json

    assert config.model.path is not None  # ModelConfig holds exactly one of hf_config and path
    try:
        return int(AutoConfig.from_pretrained(config.model.path, local_files_only=True).vocab_size)
    except (OSError, ValueError, AttributeError):
        return None  # the engine build reports an unreadable checkpoint with its own message
