"""The built-in loop's default optimizer step against torch's fused AdamW: what ``drift_step="auto"``
costs under the default schedule (drift measured at every 10th step), alone and in the whole
training step. Issue 55's GPU check (goal: at most 1% of the training step on the 0.5B shape).

Two measurements, each interleaved (``layercheck.bench.timing.time_interleaved``):

* **the optimizer step** over the model's layer-aligned groups (fp32 masters, fixed gradients):
  torch's ``AdamW(fused=True)`` (the baseline), and ``DriftAdamW()`` as the built-in loop builds
  it, measuring one step in ten (``default@10``, per step, the drift read to the host as the probe
  reads it) and every step (``default@1``);
* **the whole training step** through one DeepSpeed engine (1 rank, ZeRO-0), as ``layercheck
  train`` builds it: its drift probe measuring one step in ten (``default@10``), and measuring none
  (``unmeasured``: every step then torch's fused AdamW, called as DriftAdamW calls it).

The optimizer's choice (:mod:`layercheck.workers.drift.choice`) is recorded with the figures.

    python bench/probes/default_step.py --preset h200-0.5b --out default_step-qwen0.5b.json
    python bench/probes/default_step.py --steps 1          # the small model on CPU: the plumbing
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
from collections.abc import Callable
from typing import Any

import torch

from layercheck.bench.drift_probe import PRESETS, SAMPLE_EVERY, Preset, _groups
from layercheck.bench.timing import time_interleaved

logger = logging.getLogger(__name__)

#: The issue's goal: the default step's cost over torch's fused AdamW, as a share of the training step.
GOAL = 0.01
NEVER = 10**9  # a drift schedule that measures no step after the first


def optimizer_seconds(model: torch.nn.Module, device: str, steps: int) -> tuple[dict[str, float], dict[str, str]]:
    """Median seconds per optimizer step of each variant (see the module docstring), and the
    default optimizer's choice of steps."""
    from layercheck.workers.drift.adamw import DriftAdamW

    groups = _groups(model, device)
    adamw = torch.optim.AdamW(
        [{k: v for k, v in g.items() if k not in ("name", "layer")} for g in groups], lr=1e-5, fused=True
    )
    default = DriftAdamW(_groups(model, device), lr=1e-5)
    every_step = DriftAdamW(_groups(model, device), lr=1e-5)

    def read(optimizer: DriftAdamW) -> None:
        drift = optimizer.take_drift()
        if drift:  # the probe's one sync a measured step
            torch.stack(list(drift.values())).cpu()

    def sampled() -> None:
        for i in range(SAMPLE_EVERY):
            default.measuring = i == 0
            default.step()
            read(default)

    def measured() -> None:
        every_step.step()
        read(every_step)

    seconds = time_interleaved(
        {"adamw_fused": adamw.step, f"default@{SAMPLE_EVERY}": sampled, "default@1": measured}, device, steps
    )
    seconds[f"default@{SAMPLE_EVERY}"] /= SAMPLE_EVERY
    choice = default.steps
    assert choice is not None
    return seconds, {"measured": choice.measured, "torch_step": choice.torch_step, "reason": choice.reason}


def training_seconds(preset: Preset, steps: int) -> dict[str, float]:
    """Median seconds per whole training step, the probe measuring one step in ten and none,
    interleaved on one engine (DeepSpeed builds one per process)."""
    from layercheck.workers.config import EngineConfig, ModelConfig, OptimConfig
    from layercheck.workers.engine import build_engine, shutdown
    from layercheck.workers.step import train_step

    train_engine = build_engine(
        ModelConfig(hf_config=preset.model),
        OptimConfig(lr=1e-5, weight_decay=0.1),
        EngineConfig(zero_stage=0, precision=preset.precision, micro_batch=preset.micro_batch),
    )
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, preset.model["vocab_size"], (preset.micro_batch, preset.seq), generator=g)

    def steps_measuring_every(every: int) -> Callable[[], None]:
        def run() -> None:  # SAMPLE_EVERY steps, exactly one measured when every == SAMPLE_EVERY
            train_engine.probe.measure_every(every)
            train_engine.probe.reset(train_engine.step + 1)
            for _ in range(SAMPLE_EVERY):
                train_step(train_engine, [ids])

        return run

    fns = {f"default@{SAMPLE_EVERY}": steps_measuring_every(SAMPLE_EVERY), "unmeasured": steps_measuring_every(NEVER)}
    seconds = {name: s / SAMPLE_EVERY for name, s in time_interleaved(fns, preset.device, steps).items()}
    shutdown(train_engine)
    return seconds


def run(preset_name: str, steps: int | None = None, device: str | None = None) -> dict[str, Any]:
    from layercheck.bench.machine import describe
    from layercheck.workers.config import ModelConfig
    from layercheck.workers.engine import build_model

    preset = PRESETS[preset_name]
    preset = dataclasses.replace(preset, steps=steps or preset.steps, device=device or preset.device)
    if preset.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"preset {preset_name} on cuda: torch.cuda.is_available() is False")
    model = build_model(ModelConfig(hf_config=preset.model))
    numel = sum(p.numel() for p in model.parameters())
    optimizer, choice = optimizer_seconds(model, preset.device, preset.steps)
    del model
    if preset.device == "cuda":
        torch.cuda.empty_cache()
    training = training_seconds(preset, max(1, preset.steps // 3))  # SAMPLE_EVERY steps a call
    base, default = optimizer["adamw_fused"], optimizer[f"default@{SAMPLE_EVERY}"]
    share = (default - base) / training["unmeasured"]
    return {
        "preset": preset_name,
        "device": preset.device,
        "precision": preset.precision,
        "params": numel,
        "steps": preset.steps,
        "choice": choice,
        "optimizer_s": optimizer,
        "default_x_adamw_fused": default / base,
        "default_every_step_x_adamw_fused": optimizer["default@1"] / base,
        "training_step_s": training,
        "extra_of_training_step": share,
        "whole_step_extra": training[f"default@{SAMPLE_EVERY}"] / training["unmeasured"] - 1,
        "goal": GOAL,
        "goal_met": share <= GOAL,
        "machine": describe(),
    }


def table(result: dict[str, Any]) -> str:
    opt, train = result["optimizer_s"], result["training_step_s"]
    choice = result["choice"]
    return "\n".join(
        [
            f"{result['preset']} on {result['device']}: {result['params'] / 1e6:.2f}M params, medians of {result['steps']}",
            f"default step: measured {choice['measured']}, torch's {choice['torch_step']} AdamW otherwise ({choice['reason']})",
            f"torch AdamW fused      {opt['adamw_fused'] * 1e3:9.3f} ms",
            f"default, every 10th    {opt[f'default@{SAMPLE_EVERY}'] * 1e3:9.3f} ms  {result['default_x_adamw_fused']:.3f}x",
            f"default, every step    {opt['default@1'] * 1e3:9.3f} ms  {result['default_every_step_x_adamw_fused']:.3f}x",
            f"training step          {train['unmeasured'] * 1e3:9.3f} ms unmeasured, "
            f"{train[f'default@{SAMPLE_EVERY}'] * 1e3:.3f} ms default ({result['whole_step_extra']:+.2%})",
            f"default step's extra   {result['extra_of_training_step']:.3%} of the training step "
            f"(goal <= {GOAL:.0%}: {'met' if result['goal_met'] else 'NOT met'})",
        ]
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu-small")
    parser.add_argument("--steps", type=int, default=None, help="timed optimizer steps per variant (after 3 warm-up)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None, help="override the preset's device")
    parser.add_argument("--json", action="store_true", help="print JSON instead of the table")
    parser.add_argument("--out", default=None, help="also write the JSON to this file")
    args = parser.parse_args(argv)
    result = run(args.preset, args.steps, args.device)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
    print(json.dumps(result, indent=2) if args.json else table(result))


if __name__ == "__main__":
    main()
