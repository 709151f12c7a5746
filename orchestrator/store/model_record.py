"""What ``export`` needs of a run LayerCheck did not build the model of: ``model.json``.

``layercheck train`` keeps its whole config in ``run.json``. A user's own loop
(``layercheck.LayerCheckTrainer`` with ``attach`` or the Trainer callback) builds its model
itself, so its driver records what it knows of it instead: the ``transformers`` config the
layers were planned from, and where the tokenizer came from (``CheckpointConfig(tokenizer=...)``;
``None`` when the user named none, which ``export`` then says). JSON only.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from layercheck.orchestrator.store.errors import ManifestError
from layercheck.orchestrator.store.fs import StoreFS

MODEL_FILE = "model.json"
MODEL_FORMAT = "layercheck.model/1"


@dataclass(frozen=True)
class ModelRecord:
    hf_config: dict[str, Any]
    """``PretrainedConfig.to_diff_dict()`` of the run's model (``model_type`` included)."""
    tokenizer: str | None = None
    """A local tokenizer directory or a Hugging Face name; ``None``: the run named none."""


def hf_config_of(model: Any) -> dict[str, Any] | None:
    """The ``transformers`` config of ``model`` (a config, or a module carrying one) as a dict;
    ``None`` for anything else (a bare ``torch.nn.Module``, a function, a layer map)."""
    config = model if hasattr(model, "to_diff_dict") else getattr(model, "config", None)
    if config is None or not hasattr(config, "to_diff_dict"):
        return None
    data = dict(config.to_diff_dict())
    data.setdefault("model_type", config.model_type)
    return data


def write_model_record(fs: StoreFS, record: ModelRecord) -> None:
    fs.write_bytes(
        MODEL_FILE,
        json.dumps({"format": MODEL_FORMAT, "hf_config": record.hf_config, "tokenizer": record.tokenizer}).encode(),
    )


def read_model_record(fs: StoreFS) -> ModelRecord | None:
    """The store's ``model.json``; ``None`` if it has none; :class:`ManifestError` naming it if damaged."""
    try:
        raw = fs.read_bytes(MODEL_FILE)
    except FileNotFoundError:
        return None
    try:
        data = json.loads(raw)
        if data.get("format") != MODEL_FORMAT:
            raise ValueError(f"format is {data.get('format')!r}, expected {MODEL_FORMAT!r}")
        hf_config = data["hf_config"]
        tokenizer = data.get("tokenizer")
        if not isinstance(hf_config, dict) or "model_type" not in hf_config:
            raise ValueError("hf_config must be a transformers config dict with a model_type")
        if tokenizer is not None and not isinstance(tokenizer, str):
            raise ValueError(f"tokenizer must be a string or null, got {tokenizer!r}")
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise ManifestError(f"{fs.uri(MODEL_FILE)}: not a valid model record ({error})") from None
    return ModelRecord(hf_config=hf_config, tokenizer=tokenizer)
