"""Per-rank job for the SFT loop test (spawned by tests/support/dist_harness.py; must be importable):
the built-in loop on SFT data with a real DeepSpeed engine."""

from __future__ import annotations

from typing import Any

import torch

from layercheck.workers.data.batch import Batch
from layercheck.workers.data.dataset import DataConfig, load_dataset
from layercheck.workers.engine import shutdown
from layercheck.workers.loop import run_loop
from layercheck.workers.step import eval_loss
from tests.support.engines import make_engine
from tests.support.models import SFT_LLAMA


class NoCheckpoints:
    """A coordinator that never persists: this job is about the data, not the protocol."""

    def report(self, drift, lr):
        return None

    def decision(self, handle):
        return None

    def persist(self, shards, *, base):
        raise AssertionError("nothing is decided, so nothing is persisted")

    def progress(self, progress):
        pass


def sft_loop_job(rank: int, world_size: int, path: str, tokenizer: str, packing: bool, steps: int) -> dict[str, Any]:
    train_engine = make_engine(
        3,
        hf_config=SFT_LLAMA,
        seed=3,
        grad_accum=2,
        lr=3e-3,
        weight_decay=0.0,
        warmup_steps=1,
        total_steps=steps,
        min_lr_ratio=0.0,
        schedule="constant",
    )
    dataset = load_dataset(DataConfig(format="sft", path=path, tokenizer=tokenizer, seq_len=64, packing=packing))
    probe = dataset.micro_batch(step=1, micro=0, rank=0, world_size=1, micro_batch=2, grad_accum=1)
    out: dict[str, Any] = {}
    ids = probe.input_ids
    # a Batch with labels = inputs and full attention is the text path's loss, exactly
    out["tensor_vs_batch"] = (
        eval_loss(train_engine, ids),
        eval_loss(train_engine, Batch(ids, ids.clone(), torch.ones_like(ids))),
    )
    # padding changes nothing: one example padded to seq_len vs the same example alone
    n = int(probe.attention_mask[0].sum())
    padded = Batch(probe.input_ids[:1], probe.labels[:1], probe.attention_mask[:1])
    alone = Batch(probe.input_ids[:1, :n], probe.labels[:1, :n], probe.attention_mask[:1, :n])
    out["padded_vs_alone"] = (eval_loss(train_engine, padded), eval_loss(train_engine, alone))
    out["probe_before"] = eval_loss(train_engine, probe)
    result = run_loop(
        train_engine, dataset, NoCheckpoints(), start_step=1, end_step=steps, rank=rank, world_size=world_size
    )
    out["losses"] = [result.losses[s] for s in sorted(result.losses)]
    out["probe_after"] = eval_loss(train_engine, probe)
    shutdown(train_engine)
    return out
