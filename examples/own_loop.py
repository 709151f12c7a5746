"""Your own Ray Train + DeepSpeed fine-tuning loop, with LayerCheck attached.

Everything here is the user's: a tiny Llama built from a transformers config, prompt/completion
pairs made up on the spot (byte-level tokens, no downloads), an answer-only loss, a DeepSpeed
config dict (ZeRO-2, AdamW, warm-up/decay schedule) and the loop. LayerCheck adds the lines
marked ``# LayerCheck``. Runs on CPU with 2 workers:

    python examples/own_loop.py                          # 30 steps, rank 1 SIGKILLed after step 12
    python examples/own_loop.py --kill-at-step 0         # no failure
    python examples/own_loop.py --in-place               # only the lost worker is replaced; rank 0 keeps its process
    python examples/own_loop.py --in-place --spares 1    # and a warm spare, its model built, takes the lost rank
    ray job submit --working-dir . -- python examples/own_loop.py --storage /shared/own-loop
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


def ds_config(stage: int, steps: int, micro: int) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": stage},
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01, "torch_adam": True}},
        "scheduler": {
            "type": "WarmupDecayLR",
            "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 3e-3, "warmup_num_steps": 3, "total_num_steps": steps},
        },
        "steps_per_print": 10**9,
    }


def train_loop_per_worker(config: dict[str, Any]) -> None:
    import deepspeed
    import ray.train

    warnings.filterwarnings("ignore", category=FutureWarning)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(MODEL, dtype=torch.float32)
    pairs = make_pairs()
    # A warm spare (--spares) runs this loop up to here, and waits in deepspeed.initialize (it needs the
    # process group) until it takes a lost worker's place; so the rank is read after it.
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        model_parameters=model.parameters(),
        config=ds_config(config["zero_stage"], config["steps"], config["micro"]),
    )
    rank, world = ray.train.get_context().get_world_rank(), ray.train.get_context().get_world_size()
    lc = layercheck.attach(engine)  # LayerCheck: on a restart, loads the composite; says where to start
    for step in range(lc.start_step, config["steps"] + 1):
        ids, labels = batch_at(pairs, step, rank, world, config["micro"])
        loss = answer_loss(engine(input_ids=ids).logits, labels)
        engine.backward(loss)
        engine.step()
        lc.after_step(step, loss=loss)  # LayerCheck: drift report, decision, snapshots
    lc.finish()  # LayerCheck: the last step's snapshots
    ray.train.report({"rank": rank, "world": world})  # Ray Train's own report (with spares: not waiting for them)
    engine.destroy()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--zero-stage", type=int, default=2)
    parser.add_argument("--micro", type=int, default=4)
    parser.add_argument(
        "--storage",
        default=os.path.join(tempfile.gettempdir(), "layercheck-own-loop"),
        help="checkpoint store (path or URI; the default is overwritten)",
    )
    parser.add_argument(
        "--policy",
        choices=["staggered", "every-step"],
        default="staggered",
        help="staggered: the default schedule, each layer saved every --period steps, the saves spread "
        "over the steps; every-step: every layer persisted after every step (exact recovery)",
    )
    parser.add_argument("--period", type=int, default=5, help="staggered: steps between a layer's saves")
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
        help="with --in-place: warm spares, extra workers that run this loop up to its process group and wait "
        "to take a lost worker's place",
    )
    parser.add_argument("--result-json", help="write the losses and the summary here")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    every_step = args.policy == "every-step"
    # the default schedule with a period that fits a run of a few dozen steps (its default: 100)
    policy = IntervalConfig(interval=1) if every_step else StaggeredConfig(period=args.period)
    # every step: let each layer's versions queue up rather than be held back until the last one commits
    persistence = layercheck.PersistenceConfig(max_versions_in_flight=64 if every_step else 2)
    trainer = layercheck.LayerCheckTrainer(
        train_loop_per_worker,
        train_loop_config={"steps": args.steps, "zero_stage": args.zero_stage, "micro": args.micro},
        model=MODEL,  # LayerCheck plans the layers from it (no weights are built)
        checkpoint=layercheck.CheckpointConfig(  # LayerCheck
            storage=args.storage,
            name="own-loop",
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
            storage_path=tempfile.mkdtemp(prefix="own-loop-ray-"), failure_config=FailureConfig(max_failures=2)
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
