"""A run's tokenizer kept in its store, for an own loop whose tokenizer is an object in its workers
(a Hugging Face ``Trainer``'s ``processing_class``) rather than a name the driver was given.

Its files are what ``save_pretrained`` writes, each written atomically under ``tokenizer/`` (the
store's filesystem: local, NFS, S3, GCS); ``model.json`` then names them
(``ModelRecord.tokenizer_files``), rewritten last, so the record never names a file that is not
whole. ``layercheck export --format hf`` reads them back (:func:`read_tokenizer_files`). A run that
named its tokenizer (``CheckpointConfig(tokenizer=...)``) keeps that name and no files.
"""

from __future__ import annotations

import dataclasses
import logging
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from layercheck.orchestrator.store.fs import StoreFS

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase
from layercheck.orchestrator.store.model_record import (
    MODEL_FILE,
    TOKENIZER_DIR,
    TOKENIZER_FILE,
    ModelRecord,
    read_model_record,
    write_model_record,
)

logger = logging.getLogger(__name__)


def keep_tokenizer(fs: StoreFS, tokenizer: PreTrainedTokenizerBase) -> tuple[str, ...]:
    """Save ``tokenizer`` (anything with ``save_pretrained``) into the store and name its files in
    ``model.json``; the files kept, or none where the record names a tokenizer already (a named
    one, or one kept by an earlier worker group of the run) or there is no record (``model=`` was
    no ``transformers`` model: the export then takes a run file, which names its tokenizer)."""
    record = read_model_record(fs)
    if record is None:
        logger.info("the run's tokenizer is not kept: the store has no %s to record it in", MODEL_FILE)
        return ()
    if record.tokenizer is not None or record.tokenizer_files:
        return ()
    with tempfile.TemporaryDirectory(prefix="layercheck-tokenizer-") as folder:
        tokenizer.save_pretrained(folder)
        paths = sorted(Path(folder).iterdir())
        odd = [p.name for p in paths if not (p.is_file() and TOKENIZER_FILE.fullmatch(p.name))]
        if odd:
            raise ValueError(f"the tokenizer's save_pretrained wrote what a run's {TOKENIZER_DIR}/ cannot hold: {odd}")
        for path in paths:
            fs.write_bytes(f"{TOKENIZER_DIR}/{path.name}", path.read_bytes())
    names = tuple(p.name for p in paths)
    write_model_record(fs, dataclasses.replace(record, tokenizer_files=names))
    logger.info("kept the run's tokenizer in %s (%s)", fs.uri(TOKENIZER_DIR), ", ".join(names))
    return names


def read_tokenizer_files(fs: StoreFS, record: ModelRecord) -> dict[str, bytes]:
    """The tokenizer files ``record`` names, by name, read from the store's ``tokenizer/``."""
    return {name: fs.read_bytes(f"{TOKENIZER_DIR}/{name}") for name in record.tokenizer_files}
