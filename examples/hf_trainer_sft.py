"""TRL ``SFTTrainer`` with DeepSpeed inside Ray Train, with LayerCheck added by a callback.

Everything here is what a Hugging Face user already writes: a tiny Llama built from a
transformers config, the project's SFT data (``examples/data/sft.jsonl``, its prompt/completion
rows: TRL masks the prompts, so the loss is on the answers only) and tokenizer with a chat
template, ``SFTConfig`` with a DeepSpeed config of ``"auto"`` values (ZeRO-2), Ray Train's
``prepare_trainer``. LayerCheck adds the lines marked ``# LayerCheck``. Runs on CPU with 2 workers:

    python examples/hf_trainer_sft.py                        # 16 steps, rank 1 SIGKILLed after step 9
    python examples/hf_trainer_sft.py --kill-at-step 0       # no failure
    python examples/hf_trainer_sft.py --lora                 # a LoRA adapter (peft) on the frozen model
    python examples/hf_trainer_sft.py --in-place             # only the lost worker is replaced
    python examples/hf_trainer_sft.py --in-place --spares 1  # and a warm spare takes the lost rank
    ray job submit --working-dir . -- python examples/hf_trainer_sft.py --storage /shared/hf-sft
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch
import transformers
from ray.train import FailureConfig, RunConfig, ScalingConfig

import layercheck  # LayerCheck
from layercheck.policies import IntervalConfig, StaggeredConfig  # LayerCheck

DATA = Path(__file__).resolve().parent / "data"
MODEL = transformers.LlamaConfig(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    tie_word_embeddings=False,
)
#: ``--lora``: the adapter TRL wraps the model in (``SFTTrainer(peft_config=...)``).
LORA: dict[str, Any] = {
    "r": 4,
    "lora_alpha": 8,
    "lora_dropout": 0.0,
    "target_modules": ["q_proj", "v_proj"],
    "task_type": "CAUSAL_LM",
}


def lora_model() -> torch.nn.Module:
    """The model as the workers train it with ``--lora``: LayerCheck plans its layers from this
    (built on the meta device: no weights)."""
    import peft

    return peft.get_peft_model(transformers.AutoModelForCausalLM.from_config(MODEL), peft.LoraConfig(**LORA))


def ds_config(stage: int, schedule: str) -> dict[str, Any]:
    """A DeepSpeed config as the Trainer docs write it: "auto" values filled in from SFTConfig.
    ``schedule="trainer"`` leaves the scheduler out: the Trainer builds its own (``lr_scheduler_type``)
    and DeepSpeed steps it."""
    config = {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "zero_optimization": {"stage": stage},
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto", "torch_adam": True}},
        "scheduler": {
            "type": "WarmupDecayLR",
            "params": {
                "warmup_min_lr": "auto",
                "warmup_max_lr": "auto",
                "warmup_num_steps": "auto",
                "total_num_steps": "auto",
            },
        },
        "steps_per_print": 10**9,
    }
    if schedule == "trainer":
        del config["scheduler"]
    return config


def sft_rows(limit: int) -> list[dict[str, str]]:
    """The data set's prompt/completion pairs (its chats are left out: their template marks no
    assistant turns, which TRL's assistant-only loss needs)."""
    with open(DATA / "sft.jsonl") as f:
        rows = [json.loads(line) for line in f]
    return [r for r in rows if "prompt" in r][:limit]


def train_loop_per_worker(config: dict[str, Any]) -> None:
    import datasets
    import ray.train.huggingface.transformers
    from trl import SFTConfig, SFTTrainer

    warnings.filterwarnings("ignore", category=FutureWarning)
    datasets.disable_progress_bars()
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(MODEL, dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(DATA / "sft-tokenizer"), local_files_only=True)
    args = SFTConfig(
        output_dir=os.path.join(tempfile.gettempdir(), "hf-sft-trainer"),
        use_cpu=True,
        deepspeed=ds_config(config["zero_stage"], config["schedule"]),
        per_device_train_batch_size=config["micro"],
        max_steps=config["steps"],
        learning_rate=3e-3,
        weight_decay=0.01,
        warmup_steps=3,
        lr_scheduler_type="cosine",
        max_grad_norm=1.0,
        max_length=64,
        seed=0,
        save_strategy="no",
        report_to=[],
        logging_steps=1,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    peft_config = None
    if config["lora"]:
        import peft

        peft_config = peft.LoraConfig(**LORA)
    trainer: transformers.Trainer = SFTTrainer(
        model=model,
        args=args,
        processing_class=tokenizer,  # the callback keeps it in the store: `layercheck export` ships it
        train_dataset=datasets.Dataset.from_list(sft_rows(config["rows"])),
        peft_config=peft_config,
    )
    trainer.add_callback(layercheck.LayerCheckCallback(trainer))  # LayerCheck: attach, resume, persist
    trainer = ray.train.huggingface.transformers.prepare_trainer(trainer)
    trainer.train()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--zero-stage", type=int, default=2)
    parser.add_argument("--micro", type=int, default=4)
    parser.add_argument("--lora", action="store_true", help="train a LoRA adapter (peft) instead of the whole model")
    parser.add_argument(
        "--schedule",
        choices=["deepspeed", "trainer"],
        default="deepspeed",
        help="the learning-rate schedule: DeepSpeed's WarmupDecayLR, or the Trainer's cosine",
    )
    parser.add_argument(
        "--rows", type=int, default=400, help="prompt/completion pairs to train on (fewer: shorter epochs)"
    )
    parser.add_argument(
        "--storage",
        default=os.path.join(tempfile.gettempdir(), "layercheck-hf-sft"),
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
        default=int(os.environ.get("LAYERCHECK_KILL_AT_STEP", 9)),
        help="SIGKILL one worker after this step (0: no failure; env LAYERCHECK_KILL_AT_STEP)",
    )
    parser.add_argument("--kill-rank", type=int, default=1)
    parser.add_argument(
        "--in-place",
        action="store_true",
        help="recover in place: Ray Train replaces only the lost worker, the survivor runs this loop again in its process",
    )
    parser.add_argument(
        "--memory-period",
        default="auto",
        type=lambda v: v if v == "auto" else int(v),
        help="steps between memory versions (persistence.memory_period): auto (the default: chosen by the run "
        "from the writers' memory and the copy's measured cost), 0 (off) or N",
    )
    parser.add_argument(
        "--spares",
        type=int,
        default=0,
        help="with --in-place: warm spares, extra workers that run this loop up to SFTConfig (it sets up the "
        "process group) and wait to take a lost worker's place",
    )
    parser.add_argument("--writers-per-node", type=int, default=1, help="checkpoint writer actors per node")
    parser.add_argument("--no-fsync", action="store_true", help="do not fsync checkpoint files (faster, less safe)")
    parser.add_argument(
        "--max-inflight-bytes",
        type=int,
        default=layercheck.PersistenceConfig().max_inflight_bytes,
        help="snapshot bytes a rank may hand to the writers before it waits for them",
    )
    parser.add_argument("--result-json", help="write the losses and the summary here")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    every_step = args.policy == "every-step"
    # the default schedule with a period that fits a run of a few dozen steps (its default: 100)
    policy = IntervalConfig(interval=1) if every_step else StaggeredConfig(period=args.period)
    # every step: let each layer's versions queue up rather than be held back until the last one commits
    persistence = layercheck.PersistenceConfig(
        writers_per_node=args.writers_per_node,
        fsync=not args.no_fsync,
        max_inflight_bytes=args.max_inflight_bytes,
        max_versions_in_flight=64 if every_step else 2,
        memory_period=args.memory_period,
    )
    trainer = layercheck.LayerCheckTrainer(
        train_loop_per_worker,
        train_loop_config={
            "steps": args.steps,
            "zero_stage": args.zero_stage,
            "micro": args.micro,
            "rows": args.rows,
            "schedule": args.schedule,
            "lora": args.lora,
        },
        model=lora_model if args.lora else MODEL,  # LayerCheck plans the layers from it (no weights are built)
        checkpoint=layercheck.CheckpointConfig(  # LayerCheck
            storage=args.storage,
            name="hf-sft",
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
            storage_path=tempfile.mkdtemp(prefix="hf-sft-ray-"), failure_config=FailureConfig(max_failures=2)
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
