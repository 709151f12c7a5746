"""Training data with a deterministic, resumable order.

The sequence a rank trains on at step ``t`` is a pure function of (seed, step, rank, world
size, batch shape): no iterator state to save, so a recovered run continues with exactly the
batches it would have seen. The order is a fresh seeded permutation of the sequences each epoch.

Text is tokenized byte-level (vocabulary 256) by default, so the bundled corpus trains with no
tokenizer download; ``tokenizer`` may instead name a local Hugging Face tokenizer directory.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

BYTE_VOCAB = 256


def bundled_corpus() -> Path:
    """The small text corpus shipped with the project (``examples/data/corpus.txt``)."""
    return Path(__file__).resolve().parent.parent / "examples" / "data" / "corpus.txt"


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """Where the text comes from and how it is cut into training sequences."""

    path: str = ""
    """A UTF-8 text file; empty means the bundled corpus."""
    tokenizer: str = "bytes"
    """``bytes`` (vocabulary 256) or a local Hugging Face tokenizer directory."""
    seq_len: int = 64
    """Tokens per training sequence."""
    seed: int = 0
    """Seeds the per-epoch shuffle."""

    def __post_init__(self) -> None:
        if self.seq_len < 2:
            raise ValueError(f"data.seq_len: must be >= 2, got {self.seq_len!r}")

    def resolved_path(self) -> Path:
        return Path(self.path) if self.path else bundled_corpus()


def tokenize(config: DataConfig) -> torch.Tensor:
    """The whole corpus as a 1-D int64 token tensor."""
    path = config.resolved_path()
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise FileNotFoundError(f"data.path: cannot read {path}: {exc.strerror or exc}") from None
    if config.tokenizer == "bytes":
        return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).to(torch.int64)
    from transformers import AutoTokenizer  # only when a real tokenizer is configured

    tokenizer = AutoTokenizer.from_pretrained(config.tokenizer, local_files_only=True)
    return torch.tensor(tokenizer(text)["input_ids"], dtype=torch.int64)


class SequenceDataset:
    """Non-overlapping ``seq_len`` windows of a token stream, in a seeded per-epoch order."""

    def __init__(self, tokens: torch.Tensor, *, seq_len: int, seed: int) -> None:
        self.count = tokens.numel() // seq_len
        if self.count < 1:
            raise ValueError(f"the corpus has {tokens.numel()} tokens, fewer than one sequence of {seq_len}")
        self.sequences = tokens[: self.count * seq_len].view(self.count, seq_len)
        self.seed = seed
        self._epoch: int | None = None
        self._order: torch.Tensor | None = None

    @classmethod
    def from_config(cls, config: DataConfig) -> SequenceDataset:
        return cls(tokenize(config), seq_len=config.seq_len, seed=config.seed)

    def sample(self, index: int) -> torch.Tensor:
        """The ``index``-th sequence of the endless shuffled stream."""
        epoch, position = divmod(index, self.count)
        if epoch != self._epoch:
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._order = torch.randperm(self.count, generator=generator)
            self._epoch = epoch
        assert self._order is not None
        return self.sequences[int(self._order[position])]

    def micro_batch(self, *, step: int, micro: int, rank: int, world_size: int, micro_batch: int,
                    grad_accum: int) -> torch.Tensor:
        """The ``[micro_batch, seq_len]`` input ids rank ``rank`` trains on in micro-step ``micro``
        of optimizer step ``step`` (steps count from 1)."""
        global_batch = world_size * micro_batch * grad_accum
        first = (step - 1) * global_batch + (micro * world_size + rank) * micro_batch
        return torch.stack([self.sample(first + i) for i in range(micro_batch)])
