"""What the training data is (``[data]`` of a run config) and what loading it found: plain
dataclasses without torch, so that the driver and the actors that only read a run config (the
supervisor, the policy) do not import it. Loading is :mod:`layercheck.workers.data.dataset`."""

from __future__ import annotations

import dataclasses
import importlib.resources
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from layercheck.policies.config_loader import require

if TYPE_CHECKING:
    from layercheck.workers.data.sft import FitReport

logger = logging.getLogger(__name__)

BYTE_VOCAB = 256
DataFormat = Literal["text", "sft"]


def bundled_corpus() -> Path:
    """The small text corpus shipped with the project (``examples/data/corpus.txt``)."""
    return Path(str(importlib.resources.files("layercheck.examples"))) / "data" / "corpus.txt"


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """Where the training data comes from and how it is cut into training sequences."""

    path: str = ""
    """``text``: a UTF-8 text file, empty means the bundled corpus. ``sft``: a JSONL file (required)."""
    format: DataFormat = "text"
    """``text``: causal-LM loss on every token of ``seq_len`` windows. ``sft``: one example a line,
    ``{"prompt": ..., "completion": ...}`` or ``{"messages": [{"role": ..., "content": ...}, ...]}``
    (rendered with the tokenizer's chat template); loss on the completion / assistant turns only."""
    tokenizer: str = "bytes"
    """``bytes`` (vocabulary 256; ``text`` only) or a local Hugging Face tokenizer directory."""
    seq_len: int = 64
    """Tokens per training sequence (``sft``: longer examples are cut, padding fills shorter ones)."""
    packing: bool = False
    """``sft`` only: pack several whole examples into each ``seq_len`` row instead of one padded
    example per row (fewer wasted tokens; packed examples share the row's causal attention)."""
    seed: int = 0
    """Seeds the per-epoch shuffle (and, with ``packing``, which examples share a row)."""

    def __post_init__(self) -> None:
        require(self.seq_len >= 2, "seq_len", ">= 2", self.seq_len)
        if self.format == "sft":
            require(bool(self.path), "path", "a JSONL file when format = 'sft'", self.path)
            require(
                self.tokenizer != "bytes",
                "tokenizer",
                "a local Hugging Face tokenizer directory when format = 'sft'",
                self.tokenizer,
            )
        elif self.packing:
            logger.warning("data.packing: ignored for format = %r (text windows are always full)", self.format)

    def resolved_path(self) -> Path:
        return Path(self.path) if self.path else bundled_corpus()

    def with_absolute_paths(self) -> DataConfig:
        """The same config with a relative ``path`` (and a relative ``tokenizer`` directory that
        exists here) made absolute against this process's working directory: workers run in
        directories of their own."""
        path = os.path.abspath(self.path) if self.path else self.path
        tokenizer = self.tokenizer
        if tokenizer != "bytes" and not os.path.isabs(tokenizer) and os.path.isdir(tokenizer):
            tokenizer = os.path.abspath(tokenizer)
        return dataclasses.replace(self, path=path, tokenizer=tokenizer)


@dataclass(frozen=True)
class DataSummary:
    """What loading the data found: for the driver's check and its log."""

    format: str
    rows: int
    vocab_size: int
    """The tokenizer's vocabulary: the model's embedding must be at least this large."""
    fit: FitReport | None = None

    def describe(self) -> str:
        text = f"{self.format} data: {self.rows} rows, tokenizer vocabulary {self.vocab_size}"
        if self.fit is not None:
            text += f", {self.fit.examples} examples ({self.fit.truncated} cut to seq_len, {self.fit.dropped} dropped)"
        return text
