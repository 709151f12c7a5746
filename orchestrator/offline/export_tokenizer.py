"""The tokenizer an export ships beside the model, so that ``AutoTokenizer.from_pretrained(OUT)``
works: a ``layercheck train`` run's ``data.tokenizer`` (or a run file's), an own loop's as its
``model.json`` records it (a named one, or the files its ``Trainer``'s callback kept in the store:
:mod:`layercheck.orchestrator.store.run_tokenizer`). Found, and loaded once, before anything is
written: a tokenizer that cannot be loaded fails the export.
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Union

from layercheck.orchestrator.core.run_config import RunConfig
from layercheck.orchestrator.offline.export_run import ExportError
from layercheck.orchestrator.store.layer_store import LayerStore
from layercheck.orchestrator.store.model_record import TOKENIZER_DIR, ModelRecord
from layercheck.orchestrator.store.run_tokenizer import read_tokenizer_files

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)


def run_tokenizer(run: RunConfig) -> PreTrainedTokenizerBase | None:
    """The tokenizer the built-in loop trained with (``data.tokenizer``); None for byte tokens."""
    if run.data.tokenizer == "bytes":
        logger.info("the run trained on byte tokens (data.tokenizer = 'bytes'): no tokenizer to export")
        return None
    return tokenizer_named(run.data.tokenizer)


def recorded_tokenizer(record: ModelRecord, store: LayerStore) -> ShippedTokenizer | None:
    """The tokenizer an own loop's ``model.json`` records: the one it names, else the files kept in
    the store; None (said plainly) where it has neither."""
    if record.tokenizer is not None:
        return tokenizer_named(record.tokenizer)
    if record.tokenizer_files:
        return StoredTokenizer.read(record, store)
    logger.warning(
        "run %s named no tokenizer (CheckpointConfig(tokenizer=...)) and kept none (the Hugging Face "
        "callback keeps the Trainer's): the export holds the model only",
        store.uri,
    )
    return None


def tokenizer_named(name: str) -> PreTrainedTokenizerBase:
    """The tokenizer ``name`` (a local directory); :class:`ExportError` if it cannot be loaded."""
    from layercheck.workers.data.sft import load_tokenizer

    try:
        return load_tokenizer(name)
    except ValueError as error:  # DataError names where it looked and why it failed
        raise ExportError(f"the run's tokenizer is needed beside the model: {error}") from None


class StoredTokenizer:
    """A tokenizer kept in the run's store, shipped as the files it was saved as (byte for byte),
    once they load as a tokenizer."""

    def __init__(self, files: dict[str, bytes]) -> None:
        self.files = files

    @classmethod
    def read(cls, record: ModelRecord, store: LayerStore) -> StoredTokenizer:
        """The files ``record`` names, checked to load with ``AutoTokenizer``; :class:`ExportError` if not."""
        try:
            kept = cls(read_tokenizer_files(store.fs, record))
        except OSError as error:
            raise ExportError(f"run {store.uri}: its tokenizer in {TOKENIZER_DIR}/ cannot be read: {error}") from None
        with tempfile.TemporaryDirectory(prefix="layercheck-tokenizer-") as folder:
            kept.save_pretrained(folder)
            try:
                tokenizer_named(folder)
            except ExportError as error:
                raise ExportError(
                    f"run {store.uri}: its tokenizer in {TOKENIZER_DIR}/ does not load: {error}"
                ) from None
        return kept

    def save_pretrained(self, folder: str) -> None:
        for name, data in self.files.items():
            (Path(folder) / name).write_bytes(data)


#: What an export ships beside the model: a loaded tokenizer (its ``save_pretrained``), or the files
#: a run kept of one (:class:`StoredTokenizer`).
ShippedTokenizer = Union["PreTrainedTokenizerBase", StoredTokenizer]
