"""Training data with a deterministic, resumable order.

Two kinds (``data.format``). ``text``: one UTF-8 file cut into non-overlapping ``seq_len``
windows, causal-LM loss on every token; tokenized byte-level (vocabulary 256) by default, so the
bundled corpus trains with no tokenizer download, or with a local Hugging Face tokenizer. ``sft``:
a JSONL file of prompt/completion pairs and chats, loss on the answers only, padded or packed to
``seq_len`` (:mod:`layercheck.workers.data.sft`).

The row a rank trains on at step ``t`` is a pure function of (seed, step, rank, world size,
batch shape) for both (:mod:`layercheck.workers.data.order`): no iterator state to save, so a recovered run
continues with exactly the batches it would have seen.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Protocol

import torch

from layercheck.workers.data.batch import MicroBatch
from layercheck.workers.data.config import BYTE_VOCAB, DataConfig, DataSummary
from layercheck.workers.data.order import EpochOrder, first_index
from layercheck.workers.data.sft import SftDataset, build_rows, load_tokenizer
from layercheck.workers.data.sft_jsonl import DataError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)


class TrainData(Protocol):
    count: int
    """Rows in one epoch."""

    def micro_batch(
        self, *, step: int, micro: int, rank: int, world_size: int, micro_batch: int, grad_accum: int
    ) -> MicroBatch:
        """What rank ``rank`` trains on in micro-step ``micro`` of optimizer step ``step``."""


def tokenize(config: DataConfig, tokenizer: PreTrainedTokenizerBase | None = None) -> torch.Tensor:
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
