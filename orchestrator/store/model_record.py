"""What ``export`` needs of a run LayerCheck did not build the model of: ``model.json``.

``layercheck train`` keeps its whole config in ``run.json``. A user's own loop
(``layercheck.LayerCheckTrainer`` with ``attach`` or the Trainer callback) builds its model
itself, so its driver records what it knows of it instead: the ``transformers`` config the
layers were planned from, where the tokenizer came from (``CheckpointConfig(tokenizer=...)``;
``None`` when the user named none) or which tokenizer files the run keeps in the store instead
(``tokenizer/``: the ``Trainer``'s own, :mod:`.run_tokenizer`), and, for a ``peft`` adapter, its
config and where its base weights come from. JSON only.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from layercheck.orchestrator.store.errors import ManifestError
from layercheck.orchestrator.store.fs import StoreFS

if TYPE_CHECKING:
    from transformers import PretrainedConfig

MODEL_FILE = "model.json"
MODEL_FORMAT = "layercheck.model/1"
#: Where a run keeps its tokenizer's files (:mod:`.run_tokenizer`), beside ``model.json``.
TOKENIZER_DIR = "tokenizer"
#: A tokenizer file's name there: what ``save_pretrained`` writes (no folder, no leading dot).
TOKENIZER_FILE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]*")


@dataclass(frozen=True)
class ModelRecord:
    hf_config: dict[str, object]
    """``PretrainedConfig.to_diff_dict()`` of the run's (base) model (``model_type`` included)."""
    tokenizer: str | None = None
    """A local tokenizer directory or a Hugging Face name; ``None``: the run named none."""
    tokenizer_files: tuple[str, ...] = ()
    """The files of the tokenizer the run keeps in the store, under ``tokenizer/`` (the
    ``Trainer``'s ``processing_class``, kept by the callback where the run named none); empty: none."""
    peft: dict[str, object] | None = None
    """A ``peft`` adapter's config (``PeftConfig.to_dict()``, JSON-safe) when the run trained one:
    its layers hold the adapter alone, the base model's weights are not in the store."""
    base_model: str | None = None
    """Where the adapter's base weights come from (``name_or_path``), for a merged export."""


def describe_model(model: object) -> ModelRecord | None:
    """What export needs of ``model`` (a ``transformers`` config, a model carrying one, or a
    ``peft`` model around one); ``None`` for anything else (a bare ``torch.nn.Module``, a layer map)."""
    config = transformers_config(model)
    if config is None:
        return None
    peft_configs = getattr(model, "peft_config", None)
    hf_config = dict(config.to_diff_dict())
    hf_config.setdefault("model_type", config.model_type)
    adapter = None
    if peft_configs:
        (adapter_config,) = peft_configs.values()  # one adapter trains; several would need naming
        adapter = _json_safe(adapter_config.to_dict())
    return ModelRecord(
        hf_config=hf_config,
        peft=adapter,
        base_model=getattr(config, "name_or_path", None) or None if adapter is not None else None,
    )


def transformers_config(model: object) -> PretrainedConfig | None:
    """The ``transformers`` config of ``model`` (a config, a model carrying one, or a ``peft`` model
    around one: its base model's); ``None`` for anything else."""
    peft_configs = getattr(model, "peft_config", None)
    base = model.get_base_model() if peft_configs and hasattr(model, "get_base_model") else model
    config = base if hasattr(base, "to_diff_dict") else getattr(base, "config", None)
    return config if config is not None and hasattr(config, "to_diff_dict") else None


def _json_safe(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (set, frozenset)):
        return sorted(_json_safe(v) for v in value)
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)  # an enum (task_type, peft_type): its value's text


def write_model_record(fs: StoreFS, record: ModelRecord) -> None:
    fs.write_bytes(MODEL_FILE, json.dumps({"format": MODEL_FORMAT, **asdict(record)}).encode())


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
        for key in ("tokenizer", "base_model"):
            if data.get(key) is not None and not isinstance(data[key], str):
                raise ValueError(f"{key} must be a string or null, got {data[key]!r}")
        adapter = data.get("peft")
        if adapter is not None and not (isinstance(adapter, dict) and "peft_type" in adapter):
            raise ValueError("peft must be a peft adapter config dict with a peft_type")
        files = data.get("tokenizer_files", [])
        if not (isinstance(files, list) and all(isinstance(f, str) and TOKENIZER_FILE.fullmatch(f) for f in files)):
            raise ValueError(f"tokenizer_files must be a list of file names, got {files!r}")
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise ManifestError(f"{fs.uri(MODEL_FILE)}: not a valid model record ({error})") from None
    return ModelRecord(
        hf_config=hf_config,
        tokenizer=tokenizer,
        tokenizer_files=tuple(files),
        peft=adapter,
        base_model=data.get("base_model"),
    )
