"""One optimizer step of causal-LM training over its micro-batches, and an evaluation loss."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from layercheck.workers.data.batch import MicroBatch, model_inputs
from layercheck.workers.drift.probe import LayerDrift
from layercheck.workers.engine import TrainEngine

logger = logging.getLogger(__name__)


def _device_of(train_engine: TrainEngine) -> torch.device:
    return torch.device(train_engine.engine.device)


def train_step(train_engine: TrainEngine, micro_batches: Sequence[MicroBatch]) -> tuple[float, LayerDrift]:
    """Forward/backward each micro-batch (token ids, labels = inputs; or a :class:`Batch` with
    its own labels and attention mask), step the optimizer, and return the mean loss and this
    rank's drift for the step."""
    if len(micro_batches) != train_engine.engine.gradient_accumulation_steps():
        raise ValueError(
            f"expected {train_engine.engine.gradient_accumulation_steps()} micro-batches, got {len(micro_batches)}"
        )
    device = _device_of(train_engine)
    total = torch.zeros((), device=device)
    for micro_batch in micro_batches:
        loss = train_engine.engine(**model_inputs(micro_batch, device)).loss
        train_engine.engine.backward(loss)
        train_engine.engine.step()
        total += loss.detach().float()
    return float(total) / len(micro_batches), train_engine.probe.collect(train_engine.step)


@torch.no_grad()
def eval_loss(train_engine: TrainEngine, micro_batch: MicroBatch) -> float:
    """The loss on ``micro_batch`` with the weights the forward reads now (no update)."""
    return float(train_engine.engine(**model_inputs(micro_batch, _device_of(train_engine))).loss)
