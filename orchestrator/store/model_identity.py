"""Is this the model the store holds the state of? The ``transformers`` config fields that shape
that state, compared field by field.

Parameter counts per layer do not tell two models apart: 4 attention heads of 16 and 8 heads of 8
(``num_key_value_heads`` 2 and 4) give every tensor the same shape, so a composite loads into the
other model without an error and trains a model nobody asked for. ``--resume`` of the built-in
loop (against ``run.json``, else ``model.json``) and ``attach`` in a user's own loop or the
Trainer callback (against ``model.json``) compare the same fields, through this module.

Values are the ones the config object reports, so the defaults ``transformers`` fills in count
(``head_dim`` is ``hidden_size // num_attention_heads`` for a Llama config without one, and a
recorded ``to_diff_dict()`` omits defaults). A field one config class does not have is not compared.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING

from layercheck.orchestrator.store.errors import ManifestError
from layercheck.orchestrator.store.fs import StoreFS
from layercheck.orchestrator.store.model_record import MODEL_FILE, read_model_record, transformers_config

if TYPE_CHECKING:
    from transformers import PretrainedConfig

logger = logging.getLogger(__name__)

IDENTITY_FIELDS: tuple[str, ...] = (
    "model_type",
    "num_hidden_layers",
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "tie_word_embeddings",
)
"""The config fields that shape a model's state (its tensors, or how they are read)."""


def model_identity(config: PretrainedConfig) -> dict[str, object]:
    """:data:`IDENTITY_FIELDS` as ``config`` (a ``transformers`` config) reports them; a field its
    class does not have (GPT-2 has no ``head_dim``) is left out."""
    identity: dict[str, object] = {}
    for name in IDENTITY_FIELDS:
        value = getattr(config, name, None)  # attribute_map aliases too: GPT-2's n_head is num_attention_heads
        if value is not None:
            identity[name] = value
    return identity


def recorded_identity(hf_config: Mapping[str, object]) -> dict[str, object]:
    """The identity of a recorded config dict with ``model_type`` (``run.json``'s
    ``model.hf_config``, ``model.json``'s ``hf_config``): through the config class, so the fields
    it left at their defaults count; where ``transformers`` cannot build it (a model type this
    version does not know), the fields the record itself holds."""
    import transformers

    fields = dict(hf_config)
    try:
        config = transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
    except (KeyError, ValueError, TypeError) as error:
        logger.info("model identity: comparing the recorded fields only (%s: %s)", type(error).__name__, error)
        return {name: hf_config[name] for name in IDENTITY_FIELDS if hf_config.get(name) is not None}
    return model_identity(config)


def identity_changes(stored: Mapping[str, object], new: Mapping[str, object]) -> list[str]:
    """``"name: stored -> new"`` for each field both identities have and on which they differ
    (a field one lacks is not compared: an older record, another config class)."""
    return [
        f"{name}: {stored[name]} -> {new[name]}"
        for name in IDENTITY_FIELDS
        if name in stored and name in new and stored[name] != new[name]
    ]


def recorded_model_changes(fs: StoreFS, model: object) -> list[str]:
    """How ``model`` (a ``transformers`` config, a model carrying one, a ``peft`` model around
    one) differs from the store's ``model.json``; none without a record or a config to compare
    (a bare ``torch.nn.Module``), or with a damaged record (logged: ``export`` names it)."""
    config = transformers_config(model)
    if config is None:
        return []
    try:
        record = read_model_record(fs)
    except ManifestError as error:
        logger.warning("%s: the model is not compared with it (%s)", MODEL_FILE, error)
        return []
    if record is None:
        return []
    return identity_changes(recorded_identity(record.hf_config), model_identity(config))
