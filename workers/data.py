"""Training data with a deterministic, resumable order.

Two kinds (``data.format``). ``text``: one UTF-8 file cut into non-overlapping ``seq_len``
windows, causal-LM loss on every token; tokenized byte-level (vocabulary 256) by default, so the
bundled corpus trains with no tokenizer download, or with a local Hugging Face tokenizer. ``sft``:
a JSONL file of prompt/completion pairs and chats, loss on the answers only, padded or packed to
``seq_len`` (:mod:`layercheck.workers.sft_data`).

The row a rank trains on at step ``t`` is a pure function of (seed, step, rank, world size,
batch shape) for both (:mod:`layercheck.workers.order`): no iterator state to save, so a recovered run
continues with exactly the batches it would have seen.
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

import torch

from layercheck.policies.config_loader import require
from layercheck.workers.batch import MicroBatch
from layercheck.workers.order import EpochOrder, first_index
from layercheck.workers.sft_data import FitReport, SftDataset, build_rows, load_tokenizer
from layercheck.workers.sft_jsonl import DataError

logger = logging.getLogger(__name__)

BYTE_VOCAB = 256
DataFormat = Literal["text", "sft"]
FORMATS: tuple[str, ...] = ("text", "sft")


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


class TrainData(Protocol):
    count: int
    """Rows in one epoch."""

    def micro_batch(
        self, *, step: int, micro: int, rank: int, world_size: int, micro_batch: int, grad_accum: int
    ) -> MicroBatch:
        """What rank ``rank`` trains on in micro-step ``micro`` of optimizer step ``step``."""


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


def tokenize(config: DataConfig, tokenizer: Any = None) -> torch.Tensor:
    """The whole text corpus as a 1-D int64 token tensor."""
    path = config.resolved_path()
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise FileNotFoundError(f"data.path: cannot read {path}: {exc.strerror or exc}") from None
    if config.tokenizer == "bytes":
        return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).to(torch.int64)
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(config.tokenizer)
    return torch.tensor(tokenizer(text)["input_ids"], dtype=torch.int64)


class SequenceDataset:
    """Non-overlapping ``seq_len`` windows of a token stream, in a seeded per-epoch order."""

    def __init__(self, tokens: torch.Tensor, *, seq_len: int, seed: int) -> None:
        self.count = tokens.numel() // seq_len
        if self.count < 1:
            raise DataError(f"data.path: the corpus has {tokens.numel()} tokens, fewer than one sequence of {seq_len}")
        self.sequences = tokens[: self.count * seq_len].view(self.count, seq_len)
        self.seed = seed
        self.order = EpochOrder(self.count, seed)

    @classmethod
    def from_config(cls, config: DataConfig) -> SequenceDataset:
        return cls(tokenize(config), seq_len=config.seq_len, seed=config.seed)

    def sample(self, index: int) -> torch.Tensor:
        """The ``index``-th sequence of the endless shuffled stream."""
        return self.sequences[self.order(index)]

    def micro_batch(
        self, *, step: int, micro: int, rank: int, world_size: int, micro_batch: int, grad_accum: int
    ) -> torch.Tensor:
        """The ``[micro_batch, seq_len]`` input ids rank ``rank`` trains on in micro-step ``micro``
        of optimizer step ``step`` (steps count from 1)."""
        first = first_index(
            step=step, micro=micro, rank=rank, world_size=world_size, micro_batch=micro_batch, grad_accum=grad_accum
        )
        return torch.stack([self.sample(first + i) for i in range(micro_batch)])


def load_data(config: DataConfig) -> tuple[TrainData, DataSummary]:
    """The configured data set, read and checked, with what was found; bad input raises
    :class:`DataError` (a ``ConfigError``) naming the field or the file and line."""
    tokenizer = None if config.tokenizer == "bytes" else load_tokenizer(config.tokenizer)
    vocab = BYTE_VOCAB if tokenizer is None else len(tokenizer)
    if config.format == "text":
        dataset = SequenceDataset(tokenize(config, tokenizer), seq_len=config.seq_len, seed=config.seed)
        return dataset, DataSummary(format="text", rows=dataset.count, vocab_size=vocab)
    rows = build_rows(
        config.resolved_path(),
        tokenizer,
        tokenizer_name=config.tokenizer,
        seq_len=config.seq_len,
        packing=config.packing,
        seed=config.seed,
    )
    summary = DataSummary(
        format="sft (packed)" if config.packing else "sft", rows=rows.count, vocab_size=vocab, fit=rows.fit
    )
    return SftDataset(rows, seed=config.seed), summary


def load_dataset(config: DataConfig) -> TrainData:
    """The configured data set (what each worker trains on)."""
    return load_data(config)[0]
