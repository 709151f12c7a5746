"""A micro-batch that says which tokens the loss is on.

The text-corpus data feeds plain ``[micro_batch, seq_len]`` token tensors (labels = inputs, every
token attended); SFT data feeds a :class:`Batch`, whose labels are ``IGNORE_INDEX`` on prompt and
padding tokens and whose attention mask is 0 on padding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: The label Hugging Face causal-LM losses skip (``CrossEntropyLoss(ignore_index=-100)``).
IGNORE_INDEX = -100


@dataclass(frozen=True)
class Batch:
    input_ids: torch.Tensor
    """``[rows, seq_len]`` int64 token ids."""
    labels: torch.Tensor
    """Like ``input_ids`` with ``IGNORE_INDEX`` where no loss is taken (the model shifts them)."""
    attention_mask: torch.Tensor
    """1 on real tokens, 0 on padding."""

    def __post_init__(self) -> None:
        if not (self.input_ids.shape == self.labels.shape == self.attention_mask.shape):
            raise ValueError(
                f"Batch: input_ids {tuple(self.input_ids.shape)}, labels {tuple(self.labels.shape)} "
                f"and attention_mask {tuple(self.attention_mask.shape)} must have one shape"
            )

    def to(self, device: torch.device) -> Batch:
        return Batch(self.input_ids.to(device), self.labels.to(device), self.attention_mask.to(device))


#: What the built-in loop feeds one forward: token ids (labels = inputs) or a :class:`Batch`.
MicroBatch = torch.Tensor | Batch


def model_inputs(micro_batch: MicroBatch, device: torch.device) -> dict[str, torch.Tensor]:
    """The keyword arguments of the model's forward for ``micro_batch`` on ``device``."""
    if isinstance(micro_batch, torch.Tensor):
        ids = micro_batch.to(device)
        return {"input_ids": ids, "labels": ids}
    batch = micro_batch.to(device)
    return {"input_ids": batch.input_ids, "labels": batch.labels, "attention_mask": batch.attention_mask}
