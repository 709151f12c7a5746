"""Micro-benchmark: what the drift probe costs, next to the plain optimizer step and the whole
training step, measured in one run on the same model.

Variants of the optimizer step over the model's layer-aligned param groups (fp32 masters):

* ``adamw``          torch AdamW (fused on CUDA, foreach on CPU): the baseline step
* ``drift_adamw``    LayerCheck's DriftAdamW, plus reading every layer's drift (one sync): the
                     probe when LayerCheck builds the optimizer (the built-in loop)
* ``snapshot_diff``  baseline step + |theta_t - reference| per layer, then the reference refreshed
                     (``workers.drift_diff.SnapshotDiffProbe``): the probe for a user's optimizer
* ``moments``        baseline step + the Adam update recomputed from exp_avg / exp_avg_sq, its L1
                     per layer (an alternative for Adam-family optimizers; not shipped, see README)
* ``l1_params``      baseline step + an L1 norm over the params (the cost floor the probe aims at)

and the whole training step (forward, backward, optimizer) through the DeepSpeed engine.

    python -m bench.drift_probe                       # small model on CPU
    python -m bench.drift_probe --preset h200-0.5b    # Qwen2.5-0.5B-shaped, batch 4x1024, on CUDA
    python -m bench.drift_probe --json                # JSON instead of the table
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Preset:
    model: dict[str, Any]
    device: str
    precision: str
    micro_batch: int
    seq: int
    steps: int


PRESETS: dict[str, Preset] = {
    "cpu-small": Preset(
        model={
            "model_type": "llama",
            "vocab_size": 512,
            "hidden_size": 256,
            "intermediate_size": 688,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 128,
        },
        device="cpu",
        precision="fp32",
        micro_batch=4,
        seq=64,
        steps=20,
    ),
    "h200-0.5b": Preset(
        model={
            "model_type": "qwen2",
            "vocab_size": 151936,
            "hidden_size": 896,
            "intermediate_size": 4864,
            "num_hidden_layers": 24,
            "num_attention_heads": 14,
            "num_key_value_heads": 2,
            "max_position_embeddings": 2048,
            "tie_word_embeddings": True,
        },
        device="cuda",
        precision="bf16",
        micro_batch=4,
        seq=1024,
        steps=30,
    ),
}


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _time(fn: Callable[[], None], device: str, steps: int, warmup: int = 3) -> float:
    """Median seconds per call."""
    for _ in range(warmup):
        fn()
    _sync(device)
    samples = []
    for _ in range(steps):
        start = time.perf_counter()
        fn()
        _sync(device)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def _time_interleaved(fns: dict[str, Callable[[], None]], device: str, steps: int, warmup: int = 3) -> dict[str, float]:
    """Median seconds per call of each function, run in turn so that load drifts hit all alike."""
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for i in range(warmup + steps):
        for name, fn in fns.items():
            _sync(device)
            start = time.perf_counter()
            fn()
            _sync(device)
            if i >= warmup:
                samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in samples.items()}


def _groups(model: torch.nn.Module, device: str) -> list[dict[str, Any]]:
    """Fresh fp32 copies of the model's layer-aligned groups, with fixed random gradients."""
    from policies.layer_map import layer_map_of
    from workers.config import OptimConfig
    from workers.engine import param_groups

    groups = param_groups(model, layer_map_of(model), OptimConfig(lr=1e-5, weight_decay=0.1))
    out = []
    for g in groups:
        params = []
        for p in g["params"]:
            q = p.detach().to(device=device, dtype=torch.float32).clone().requires_grad_(True)
            q.grad = torch.randn_like(q) * 1e-3
            params.append(q)
        out.append({**g, "params": params})
    return out


def optimizer_variants(model: torch.nn.Module, device: str) -> dict[str, Callable[[], None]]:
    from workers.drift_adamw import DriftAdamW

    fast = {"fused": True} if device == "cuda" else {"foreach": True}

    def plain() -> tuple[torch.optim.Optimizer, list[dict[str, Any]]]:
        groups = _groups(model, device)
        return torch.optim.AdamW(
            [{k: v for k, v in g.items() if k not in ("name", "layer")} for g in groups], lr=1e-5, **fast
        ), groups

    adamw, _ = plain()
    drift = DriftAdamW(_groups(model, device), lr=1e-5)
    snap, snap_groups = plain()
    reference = [[p.detach().clone() for p in g["params"]] for g in snap_groups]
    moments, moments_groups = plain()
    floor, floor_groups = plain()

    def drift_step() -> None:
        drift.step()
        values = drift.take_drift()
        torch.stack(list(values.values())).cpu()

    def snapshot_diff_step() -> None:
        snap.step()
        sums = []
        for g, ref in zip(snap_groups, reference):
            now = [p.detach() for p in g["params"]]
            sums.append(torch.stack(torch._foreach_norm(torch._foreach_sub(now, ref), 1)).sum())
            torch._foreach_copy_(ref, now)
        torch.stack(sums).cpu()

    def moments_step() -> None:
        moments.step()
        sums = []
        for g in moments_groups:
            states = [moments.state[p] for p in g["params"]]
            denom = torch._foreach_sqrt([s["exp_avg_sq"] for s in states])
            torch._foreach_add_(denom, 1e-8)
            update = torch._foreach_div([s["exp_avg"] for s in states], denom)
            sums.append(torch.stack(torch._foreach_norm(update, 1)).sum())
        torch.stack(sums).cpu()

    def l1_step() -> None:
        floor.step()
        sums = [torch.stack(torch._foreach_norm([p.detach() for p in g["params"]], 1)).sum() for g in floor_groups]
        torch.stack(sums).cpu()

    return {
        "adamw": adamw.step,
        "drift_adamw": drift_step,
        "snapshot_diff": snapshot_diff_step,
        "moments": moments_step,
        "l1_params": l1_step,
    }


def training_step_seconds(preset: Preset) -> float:
    """Median seconds of one whole training step through the DeepSpeed engine (1 rank, ZeRO-0)."""
    from workers.config import EngineConfig, ModelConfig, OptimConfig
    from workers.engine import build_engine, shutdown
    from workers.step import train_step

    train_engine = build_engine(
        ModelConfig(hf_config=preset.model),
        OptimConfig(lr=1e-5, weight_decay=0.1),
        EngineConfig(zero_stage=0, precision=preset.precision, micro_batch=preset.micro_batch),
    )
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, preset.model["vocab_size"], (preset.micro_batch, preset.seq), generator=g)
    seconds = _time(lambda: train_step(train_engine, [ids]), preset.device, preset.steps)
    shutdown(train_engine)
    return seconds


def run(preset_name: str, steps: int | None) -> dict[str, Any]:
    from workers.config import ModelConfig
    from workers.engine import build_model

    preset = PRESETS[preset_name]
    if steps:
        preset = Preset(**{**preset.__dict__, "steps": steps})
    if preset.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"preset {preset_name} needs CUDA")
    model = build_model(ModelConfig(hf_config=preset.model))
    numel = sum(p.numel() for p in model.parameters())
    optimizer = _time_interleaved(optimizer_variants(model, preset.device), preset.device, preset.steps)
    del model
    whole = training_step_seconds(preset)
    base = optimizer["adamw"]
    rows = {
        name: {
            "seconds": s,
            "overhead_s": s - base,
            "vs_optimizer_step": (s - base) / base,
            "vs_training_step": (s - base) / whole,
        }
        for name, s in optimizer.items()
        if name != "adamw"
    }
    return {
        "preset": preset_name,
        "device": preset.device,
        "params": numel,
        "steps": preset.steps,
        "optimizer_step_s": base,
        "training_step_s": whole,
        "probes": rows,
    }


def table(result: dict[str, Any]) -> str:
    lines = [
        f"{result['preset']} on {result['device']}: {result['params'] / 1e6:.2f}M params, "
        f"median of {result['steps']} steps",
        f"plain AdamW step {result['optimizer_step_s'] * 1e3:9.3f} ms   whole training step "
        f"{result['training_step_s'] * 1e3:9.3f} ms",
        f"{'variant':<14} {'step ms':>10} {'extra ms':>10} {'x opt step':>11} {'x train step':>13}",
    ]
    for name, row in result["probes"].items():
        lines.append(
            f"{name:<14} {row['seconds'] * 1e3:10.3f} {row['overhead_s'] * 1e3:10.3f} "
            f"{row['vs_optimizer_step']:11.3f} {row['vs_training_step']:13.4f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu-small")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per variant (after 3 warm-up)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of the table")
    args = parser.parse_args(argv)
    result = run(args.preset, args.steps)
    print(json.dumps(result, indent=2) if args.json else table(result))


if __name__ == "__main__":
    main()
