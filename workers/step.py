"""One optimizer step of causal-LM training over its micro-batches, and an evaluation loss, on
whichever engine the built-in loop built (:meth:`~layercheck.workers.engines.base.TrainingEngine.train_step`)."""

from __future__ import annotations

from collections.abc import Sequence

from layercheck.workers.data.batch import MicroBatch
from layercheck.workers.drift.probe import LayerDrift
from layercheck.workers.engine import TrainEngine


def train_step(train_engine: TrainEngine, micro_batches: Sequence[MicroBatch]) -> tuple[float, LayerDrift]:
    """Forward/backward each micro-batch (token ids, labels = inputs; or a :class:`Batch` with
    its own labels and attention mask), step the optimizer, and return the mean loss and this
    rank's drift for the step."""
    loss = train_engine.adapter.train_step(micro_batches)
    return loss, train_engine.probe.collect(train_engine.step)


def eval_loss(train_engine: TrainEngine, micro_batch: MicroBatch) -> float:
    """The loss on ``micro_batch`` with the weights the forward reads now (no update)."""
    return train_engine.adapter.eval_loss(micro_batch)
