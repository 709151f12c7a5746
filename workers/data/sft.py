"""SFT training rows from JSONL examples: answer-only labels, padded or packed to ``seq_len``.

Every example becomes tokens with a loss mask (:mod:`layercheck.workers.data.sft_jsonl`). One longer than
``seq_len`` is cut to ``seq_len``; one whose answer then starts past the cut has nothing left to
train on and is dropped, and the count is logged (an error when every example is dropped).
Rows are then either one example each, padded to ``seq_len`` (pad tokens: attention 0, label
-100), or several examples packed into each row in a seeded order, whole examples only, the
tail padded. Packed examples share a row's causal attention (as TRL's ``packing=True`` without a
padding-free kernel): prompts are masked, so no answer token is a target across a boundary.

The order the rows are trained in is the same pure function of (seed, step, rank, world size)
as the text corpus's (:class:`layercheck.workers.data.dataset.EpochOrder`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from layercheck.workers.data.batch import IGNORE_INDEX, Batch
from layercheck.workers.data.order import EpochOrder, first_index
from layercheck.workers.data.sft_jsonl import DataError, Encoded, check_chat_template, encode, read_records

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

#: A layout's (input_ids, labels, attention_mask), each ``(rows, seq_len)`` int64.
RowTensors = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class FitReport:
    """What cutting the examples to ``seq_len`` did."""

    examples: int
    truncated: int
    """Examples longer than ``seq_len``, cut to it (their answers lose their tails)."""
    dropped: int
    """Examples whose answer starts at or past ``seq_len``: nothing left to train on."""


@dataclass(frozen=True)
class SftRows:
    input_ids: torch.Tensor
    labels: torch.Tensor
    attention_mask: torch.Tensor
    fit: FitReport

    @property
    def count(self) -> int:
        return int(self.input_ids.shape[0])


def fit_to_length(examples: Sequence[Encoded], seq_len: int) -> tuple[list[Encoded], FitReport]:
    """The examples cut to ``seq_len``, less those with no answer token left; raises when none is left."""
    kept: list[Encoded] = []
    truncated = 0
    for example in examples:
        if len(example.ids) > seq_len:
            truncated += 1
            example = Encoded(line=example.line, ids=example.ids[:seq_len], loss=example.loss[:seq_len])
        if any(example.loss):
            kept.append(example)
    report = FitReport(examples=len(examples), truncated=truncated, dropped=len(examples) - len(kept))
    if not kept:
        shortest = min(_answer_start(e) for e in examples) + 1
        raise DataError(
            f"data.seq_len: {seq_len} is too short: all {len(examples)} examples were dropped, every "
            f"answer starts past token {seq_len} (the shortest prompt+answer needs seq_len >= {shortest})"
        )
    if report.truncated or report.dropped:
        logger.warning(
            "data: %d of %d examples are longer than seq_len=%d and were cut to it; %d of them kept no "
            "answer token and were dropped",
            report.truncated,
            report.examples,
            seq_len,
            report.dropped,
        )
    return kept, report


def _answer_start(example: Encoded) -> int:
    return next((i for i, trained in enumerate(example.loss) if trained), len(example.loss))


def _empty_rows(count: int, seq_len: int, pad_id: int) -> RowTensors:
    return (
        torch.full((count, seq_len), pad_id, dtype=torch.int64),
        torch.full((count, seq_len), IGNORE_INDEX, dtype=torch.int64),
        torch.zeros((count, seq_len), dtype=torch.int64),
    )


def _place(rows: RowTensors, row: int, start: int, example: Encoded) -> None:
    ids, labels, mask = rows
    end = start + len(example.ids)
    token_ids = torch.tensor(example.ids, dtype=torch.int64)
    ids[row, start:end] = token_ids
    labels[row, start:end] = torch.where(torch.tensor(example.loss), token_ids, IGNORE_INDEX)
    mask[row, start:end] = 1


def pad_rows(examples: Sequence[Encoded], *, seq_len: int, pad_id: int) -> RowTensors:
    """One example per row, right-padded to ``seq_len``: (input_ids, labels, attention_mask)."""
    rows = _empty_rows(len(examples), seq_len, pad_id)
    for row, example in enumerate(examples):
        _place(rows, row, 0, example)
    return rows


def pack_rows(examples: Sequence[Encoded], *, seq_len: int, pad_id: int, seed: int) -> RowTensors:
    """Whole examples, in a seeded shuffle, filled greedily into ``seq_len`` rows; each row's
    tail is padded. A pure function of (examples, seq_len, seed)."""
    order = torch.randperm(len(examples), generator=torch.Generator().manual_seed(seed)).tolist()
    bins: list[list[Encoded]] = [[]]
    used = 0
    for index in order:
        example = examples[index]
        if used + len(example.ids) > seq_len:
            bins.append([])
            used = 0
        bins[-1].append(example)
        used += len(example.ids)
    rows = _empty_rows(len(bins), seq_len, pad_id)
    for row, packed in enumerate(bins):
        start = 0
        for example in packed:
            _place(rows, row, start, example)
            start += len(example.ids)
    return rows


def load_tokenizer(name: str) -> PreTrainedTokenizerBase:
    """The local Hugging Face tokenizer in directory ``name`` (never downloads)."""
    from transformers import AutoTokenizer  # only when a real tokenizer is configured

    try:
        return AutoTokenizer.from_pretrained(name, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise DataError(
            f"data.tokenizer: cannot load a tokenizer from {name!r} (a local Hugging Face tokenizer "
            f"directory; nothing is downloaded): {exc}"
        ) from None


def pad_id_of(tokenizer: PreTrainedTokenizerBase) -> int:
    """Padding is masked out, so any id works; the tokenizer's own pad (else eos) reads best."""
    for candidate in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if candidate is not None:
            return int(candidate)
    return 0


def build_rows(
    path: Path, tokenizer: PreTrainedTokenizerBase, *, tokenizer_name: str, seq_len: int, packing: bool, seed: int
) -> SftRows:
    """Read, check, encode and lay out the data set; every bad input raises :class:`DataError`."""
    records = read_records(path)
    check_chat_template(tokenizer, records, tokenizer_name)
    examples, fit = fit_to_length([encode(tokenizer, record, path) for record in records], seq_len)
    layout = (
        pack_rows(examples, seq_len=seq_len, pad_id=pad_id_of(tokenizer), seed=seed)
        if packing
        else pad_rows(examples, seq_len=seq_len, pad_id=pad_id_of(tokenizer))
    )
    return SftRows(*layout, fit=fit)


class SftDataset:
    """SFT rows in the seeded per-epoch order; each micro-batch is a :class:`Batch`."""

    def __init__(self, rows: SftRows, *, seed: int) -> None:
        self.rows = rows
        self.count = rows.count
        self.order = EpochOrder(self.count, seed)

    def micro_batch(
        self, *, step: int, micro: int, rank: int, world_size: int, micro_batch: int, grad_accum: int
    ) -> Batch:
        """The rows rank ``rank`` trains on in micro-step ``micro`` of optimizer step ``step``
        (steps count from 1)."""
        first = first_index(
            step=step, micro=micro, rank=rank, world_size=world_size, micro_batch=micro_batch, grad_accum=grad_accum
        )
        index = torch.tensor([self.order(first + i) for i in range(micro_batch)])
        return Batch(self.rows.input_ids[index], self.rows.labels[index], self.rows.attention_mask[index])
