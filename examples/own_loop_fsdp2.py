"""Your own Ray Train + PyTorch FSDP2 fine-tuning loop, with LayerCheck attached.

Everything here is the user's: a tiny Llama built from a transformers config, prompt/completion
pairs made up on the spot (byte-level tokens, no downloads), an answer-only loss, the model sharded
with ``fully_shard`` (each decoder layer, then the root) over a 1-D mesh, torch's AdamW over a decay
and a no-decay group, a warm-up/decay ``LambdaLR`` and the loop. LayerCheck adds the lines marked
``# LayerCheck``. Runs on CPU (gloo) with 2 workers:

    python examples/own_loop_fsdp2.py                      # 30 steps, rank 1 SIGKILLed after step 12
    python examples/own_loop_fsdp2.py --kill-at-step 0     # no failure
    python examples/own_loop_fsdp2.py --in-place --memory-period 1   # the survivor keeps its process; nothing lost
    python examples/own_loop_fsdp2.py --in-place --spares 1  # and a warm spare, its model built, takes the lost rank
    python examples/own_loop_fsdp2.py --bf16               # bf16 compute over fp32 sharded masters
    python examples/own_loop_fsdp2.py --workers 4 --hsdp 2 # HSDP: 2 replicas x 2 shards
    ray job submit --working-dir . -- python examples/own_loop_fsdp2.py --storage /shared/own-loop-fsdp2
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import tempfile
import warnings
from typing import Any

import torch
import transformers
from ray.train import FailureConfig, RunConfig, ScalingConfig

import layercheck  # LayerCheck
from layercheck.policies import IntervalConfig, StaggeredConfig  # LayerCheck

SEQ = 48
IGNORE = -100
LR = 3e-3
WARMUP = 3
MODEL = transformers.LlamaConfig(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=SEQ,
    tie_word_embeddings=False,
)


def make_pairs(n: int = 400, seed: int = 0) -> list[dict[str, str]]:
    """Prompt/completion pairs: small sums, written out."""
    rng = random.Random(seed)
    pairs = []
    for _ in range(n):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        pairs.append({"prompt": f"Q: {a} plus {b}?\nA:", "completion": f" {a + b}\n"})
    return pairs


def encode(pair: dict[str, str]) -> tuple[torch.Tensor, torch.Tensor]:
    """Byte tokens and answer-only labels (prompt and padding masked), padded to SEQ."""
    prompt, answer = list(pair["prompt"].encode()), list(pair["completion"].encode())
    ids = (prompt + answer)[:SEQ]
    labels = ([IGNORE] * len(prompt) + answer)[:SEQ]
    pad = SEQ - len(ids)
    return torch.tensor(ids + [0] * pad), torch.tensor(labels + [IGNORE] * pad)


def batch_at(pairs: list[dict[str, str]], step: int, rank: int, world: int, micro: int) -> tuple[torch.Tensor, ...]:
    """The batch of ``rank`` at ``step``: a pure function of both, so a resumed run sees the same data."""
    order = random.Random(step).sample(range(len(pairs)), world * micro)
    rows = [encode(pairs[i]) for i in order[rank * micro : (rank + 1) * micro]]
    return torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows])


def answer_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy on the answer tokens only."""
    return torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.size(-1)).float(), labels[:, 1:].reshape(-1), ignore_index=IGNORE
    )


def build_model() -> torch.nn.Module:
    """The model as every rank starts it: the same seed, so the same initial weights."""
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(MODEL, dtype=torch.float32)


def shard(model: Any, world: int, bf16: bool, replicas: int = 1) -> torch.nn.Module:
    """``model`` sharded with FSDP2 over all ranks: each decoder layer, then the root; with
    ``replicas`` > 1, HSDP (a replicate x shard mesh)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if replicas > 1:
        mesh = init_device_mesh("cpu", (replicas, world // replicas), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh("cpu", (world,))
    precision = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
    options: dict[str, Any] = {"mesh": mesh, **({"mp_policy": precision} if precision else {})}
    for layer in model.model.layers:
        fully_shard(layer, **options)
    fully_shard(model, **options)
    return model


def optimizer_and_schedule(model: torch.nn.Module, steps: int) -> tuple[torch.optim.AdamW, Any]:
    """AdamW with weight decay on the matrices only, linear warm-up then linear decay."""
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}], lr=LR
    )
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: (s + 1) / WARMUP if s < WARMUP else max(0.0, (steps - s) / (steps - WARMUP))
    )
    return optimizer, schedule


def train_loop_per_worker(config: dict[str, Any]) -> None:
    import ray.train

    warnings.filterwarnings("ignore", category=FutureWarning)
    model, pairs = build_model(), make_pairs()
    # A warm spare (--spares) runs this loop up to here and waits for its rank, which it has once it
    # takes a lost worker's place; the mesh (the process group) comes after it.
    rank, world = ray.train.get_context().get_world_rank(), ray.train.get_context().get_world_size()
    model = shard(model, world, config["bf16"], config["hsdp"])
    optimizer, schedule = optimizer_and_schedule(model, config["steps"])
    # LayerCheck: on a restart, loads the composite into the shards and moves the schedule; says where to start
    lc = layercheck.attach(model, optimizer, lr_scheduler=schedule)
    for step in range(lc.start_step, config["steps"] + 1):
        ids, labels = batch_at(pairs, step, rank, world, config["micro"])
        loss = answer_loss(model(input_ids=ids).logits, labels)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        lc.after_step(step, loss=loss)  # LayerCheck: drift report, decision, snapshots
    lc.finish()  # LayerCheck: the last step's snapshots


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--micro", type=int, default=4)
    parser.add_argument("--bf16", action="store_true", help="bf16 compute (FSDP's MixedPrecisionPolicy)")
    parser.add_argument(
        "--hsdp", type=int, default=1, help="HSDP: this many replicas of the shards (--workers divisible)"
    )
    parser.add_argument(
        "--storage",
        default=os.path.join(tempfile.gettempdir(), "layercheck-own-loop-fsdp2"),
        help="checkpoint store (path or URI; the default is overwritten)",
    )
    parser.add_argument(
        "--policy",
        choices=["staggered", "every-step"],
        default="staggered",
        help="staggered: the default schedule, each layer saved every --period steps, the saves spread "
        "over the steps; every-step: every layer persisted after every step",
    )
    parser.add_argument("--period", type=int, default=5, help="staggered: steps between a layer's saves")
    parser.add_argument(
        "--memory-period",
        type=int,
        default=0,
        help="every this many steps each rank's slices are also kept in the writers' memory: a lost "
        "rank's come back at most this many steps stale (with --in-place, the survivors' are exact)",
    )
    parser.add_argument(
        "--kill-at-step",
        type=int,
        default=int(os.environ.get("LAYERCHECK_KILL_AT_STEP", 12)),
        help="SIGKILL one worker after this step (0: no failure; env LAYERCHECK_KILL_AT_STEP)",
    )
    parser.add_argument("--kill-rank", type=int, default=1)
    parser.add_argument(
        "--in-place",
        action="store_true",
        help="recover in place: Ray Train replaces only the lost worker, the survivor runs this loop again in its process",
    )
    parser.add_argument(
        "--spares",
        type=int,
        default=0,
        help="with --in-place: warm spares, extra workers that build the model and wait to take a lost worker's place",
    )
    parser.add_argument("--result-json", help="write the losses and the summary here")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    every_step = args.policy == "every-step"
    policy = IntervalConfig(interval=1) if every_step else StaggeredConfig(period=args.period)
    persistence = layercheck.PersistenceConfig(
        max_versions_in_flight=64 if every_step else 2, memory_period=args.memory_period
    )
    trainer = layercheck.LayerCheckTrainer(
        train_loop_per_worker,
        train_loop_config={"steps": args.steps, "micro": args.micro, "bf16": args.bf16, "hsdp": args.hsdp},
        model=MODEL,  # LayerCheck plans the layers from it (no weights are built)
        checkpoint=layercheck.CheckpointConfig(  # LayerCheck
            storage=args.storage,
            name="own-loop-fsdp2",
            policy=policy,
            overwrite=True,
            persistence=persistence,
            metrics=layercheck.MetricsConfig(port=0),
            fault=layercheck.FaultConfig(kill_at_step=args.kill_at_step, kill_rank=args.kill_rank),
            in_place=args.in_place,
            spares=args.spares,
        ),
        scaling_config=ScalingConfig(num_workers=args.workers, use_gpu=False),
        run_config=RunConfig(
            storage_path=tempfile.mkdtemp(prefix="own-loop-fsdp2-ray-"), failure_config=FailureConfig(max_failures=2)
        ),
    )
    result = trainer.fit()
    print(result.format())
    if args.result_json:
        with open(args.result_json, "w") as f:
            json.dump({"losses": result.losses, "summary": result.summary}, f, default=str)
    raise SystemExit(0 if result.error is None else 1)


if __name__ == "__main__":
    main()
