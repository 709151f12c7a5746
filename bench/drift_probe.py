"""Micro-benchmark: what the drift probe costs, next to the plain optimizer step and the whole
training step, measured in one run on the same model.
One file because it is one measurement: its figures are ratios between variants timed interleaved
in one process on one model, so the variants, the kernel sweep and the training step it divides by
share the presets, the parameter groups and the timing, and are read only together (``run``).

Variants of the optimizer step over the model's layer-aligned param groups (fp32 masters):

* ``adamw``          torch AdamW (fused on CUDA, foreach on CPU): the baseline step
* ``adamw_foreach``, ``adamw_fused``, ``adamw_single``  torch AdamW's other implementations
                     (``adamw_single``: foreach=False, what the fused probe matches bit for bit)
* ``drift_adamw``    LayerCheck's DriftAdamW, plus reading every layer's drift (one sync): the
                     probe when LayerCheck builds the optimizer (the built-in loop)
* ``drift_fused``    DriftAdamW with ``drift_step="fused"`` (drift counted inside the update; a
                     Triton kernel on CUDA), plus the same read
* ``snapshot_diff``  baseline step + |theta_t - reference| per layer, then the reference refreshed
                     (``layercheck.workers.drift.diff.SnapshotDiffProbe``): the probe for a user's optimizer
* ``moments``        baseline step + the Adam update recomputed from exp_avg / exp_avg_sq, its L1
                     per layer (an alternative for Adam-family optimizers; not shipped, see docs/drift-probes.md)
* ``l1_params``      baseline step + an L1 norm over the params (the cost floor the probe aims at)
* ``step_hooks``     the user's AdamW with ``layercheck.workers.drift.hooks.StepHookProbe`` around its
                     step (a copy before, the diff after): ``attach``'s and the callback's probe
* ``step_hooks_fused``  (CPU) the same probe running the fused step in the user's AdamW's place
* ``drift_adamw@10``, ``snapshot_diff@10``, ``step_hooks@10``, ``step_hooks_fused@10``  the probes
                     measuring every 10th step (the default schedule's ``drift_every``), per step:
                     the plain step on the other nine
* ``adamw/new_grads``, ``drift_fused/new_grads``  the baseline and the fused step with new gradient
                     tensors at every step (a loop that sets them to ``None``; DeepSpeed's ZeRO-0 fp32
                     copies of bf16 gradients, the ``qwen2.5-0.5b`` bench preset's case), and their
                     ratio (``fused_x_adamw_new_grads``)

and the whole training step (forward, backward, optimizer) through the DeepSpeed engine.

    python -m layercheck.bench.drift_probe                       # small model on CPU
    python -m layercheck.bench.drift_probe --preset h200-0.5b    # Qwen2.5-0.5B-shaped, batch 4x1024, on CUDA
    python -m layercheck.bench.drift_probe --device cuda         # the small model on a GPU
    python -m layercheck.bench.drift_probe --json                # JSON instead of the table
    python -m layercheck.bench.drift_probe --out result.json     # the table, and the JSON written to a file
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from layercheck.bench.timing import issue_seconds, time_interleaved
from layercheck.policies.layer_map import LayerMap
from layercheck.workers.config import Precision

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Preset:
    model: dict[str, Any]
    device: str
    precision: Precision
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


def _groups(model: torch.nn.Module, device: str) -> list[dict[str, Any]]:
    """Fresh fp32 copies of the model's layer-aligned groups, with fixed random gradients."""
    from layercheck.policies.layer_map import layer_map_of
    from layercheck.workers.config import OptimConfig
    from layercheck.workers.engine import param_groups

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
    from layercheck.policies.layer_map import layer_map_of
    from layercheck.workers.drift.adamw import DriftAdamW
    from layercheck.workers.drift.fused import triton_eligible

    fast: dict[str, Any] = {"fused": True} if device == "cuda" else {"foreach": True}  # AdamW's kernel switch

    def plain(**kind: Any) -> tuple[torch.optim.Optimizer, list[dict[str, Any]]]:
        groups = _groups(model, device)
        return torch.optim.AdamW(
            [{k: v for k, v in g.items() if k not in ("name", "layer")} for g in groups], lr=1e-5, **(kind or fast)
        ), groups

    adamw, adamw_groups = plain()
    kinds: dict[str, dict[str, Any]] = {
        "adamw_foreach": {"foreach": True},
        "adamw_fused": {"fused": True},
        "adamw_single": {"foreach": False},
    }
    # (each variant holds its own copy of the model's state: 8 GB for the 0.5B shape, so none twice)
    others = {name: plain(**kind)[0].step for name, kind in kinds.items() if kind != fast}
    drift = DriftAdamW(_groups(model, device), lr=1e-5)
    fused = DriftAdamW(_groups(model, device), lr=1e-5, drift_step="fused")
    if device == "cuda" and not triton_eligible([p for g in fused.param_groups for p in g["params"]]):
        raise SystemExit("drift_fused on CUDA needs Triton (pip install triton): the kernel would not run")
    snap, snap_groups = plain()
    reference = [[p.detach().clone() for p in g["params"]] for g in snap_groups]
    moments, moments_groups = plain()
    floor, floor_groups = plain()

    def read_after_step(optimizer: DriftAdamW) -> Callable[[], None]:
        """``optimizer``'s step, then its drift read to the host (the probe's one sync a step)."""

        def stepped() -> None:
            optimizer.step()
            torch.stack(list(optimizer.take_drift().values())).cpu()

        return stepped

    drift_step, fused_step = read_after_step(drift), read_after_step(fused)

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

    sampled = DriftAdamW(_groups(model, device), lr=1e-5)
    snap_sampled, snap_sampled_groups = plain()
    sampled_reference = [[p.detach().clone() for p in g["params"]] for g in snap_sampled_groups]

    def sampled_drift_steps() -> None:
        """SAMPLE_EVERY steps of a sampled probe: DriftAdamW measuring the first (and reading
        it), torch's own step on the others."""
        for i in range(SAMPLE_EVERY):
            sampled.measuring = i == 0
            sampled.step()
            if i == 0:
                torch.stack(list(sampled.take_drift().values())).cpu()

    def sampled_snapshot_steps() -> None:
        """SAMPLE_EVERY steps of the sampled snapshot probe: a diff after the first, the
        reference copied before the next period's first; nothing on the others."""
        for i in range(SAMPLE_EVERY):
            snap_sampled.step()
            if i == 0:
                sums = []
                for g, ref in zip(snap_sampled_groups, sampled_reference):
                    now = [p.detach() for p in g["params"]]
                    sums.append(torch.stack(torch._foreach_norm(torch._foreach_sub(now, ref), 1)).sum())
                torch.stack(sums).cpu()
            elif i == SAMPLE_EVERY - 1:
                for g, ref in zip(snap_sampled_groups, sampled_reference):
                    torch._foreach_copy_(ref, [p.detach() for p in g["params"]])

    def hooked(fused: bool, every: int = 1) -> Callable[[], None]:
        """``every`` steps of the user's AdamW with :class:`StepHookProbe` around them, each read."""
        optimizer, groups = plain()
        probe = _hook_probe(optimizer, groups, layer_map_of(model), fused=fused, every=every)
        step = [0]

        def steps() -> None:
            for _ in range(every):
                step[0] += 1
                optimizer.step()
                probe.collect(step[0])

        return steps

    hook_variants = {"step_hooks": hooked(False), f"step_hooks@{SAMPLE_EVERY}": hooked(False, SAMPLE_EVERY)}
    if device == "cpu":  # (on CUDA the fused step in place of the user's does not count per layer yet)
        hook_variants |= {
            "step_hooks_fused": hooked(True),
            f"step_hooks_fused@{SAMPLE_EVERY}": hooked(True, SAMPLE_EVERY),
        }

    def new_grads(step: Callable[[], Any], params: list[torch.Tensor]) -> Callable[[], None]:
        """``step`` with new gradient tensors at every call (two sets, in turn): as a loop that sets
        them to ``None``, or DeepSpeed's ZeRO-0 fp32 copies of bf16 gradients, brings them."""
        new: list[torch.Tensor | None] = [torch.randn_like(p) * 1e-3 for p in params]
        sets = itertools.cycle([new, [p.grad for p in params]])

        def stepped() -> None:
            for p, grad in zip(params, next(sets)):
                p.grad = grad
            step()

        return stepped

    fused_new = DriftAdamW(_groups(model, device), lr=1e-5, drift_step="fused")
    new_grad_variants = {
        # the baseline's own optimizer: torch's step keeps nothing of its tensors from step to step
        "adamw/new_grads": new_grads(adamw.step, [p for g in adamw_groups for p in g["params"]]),
        "drift_fused/new_grads": new_grads(
            read_after_step(fused_new), [p for g in fused_new.param_groups for p in g["params"]]
        ),
    }

    def l1_step() -> None:
        floor.step()
        sums = [torch.stack(torch._foreach_norm([p.detach() for p in g["params"]], 1)).sum() for g in floor_groups]
        torch.stack(sums).cpu()

    return {
        "adamw": adamw.step,
        **others,
        "drift_adamw": drift_step,
        "drift_fused": fused_step,
        "snapshot_diff": snapshot_diff_step,
        "moments": moments_step,
        "l1_params": l1_step,
        f"drift_adamw@{SAMPLE_EVERY}": sampled_drift_steps,
        f"snapshot_diff@{SAMPLE_EVERY}": sampled_snapshot_steps,
        **hook_variants,
        **new_grad_variants,
    }


def _hook_probe(
    optimizer: torch.optim.Optimizer, groups: list[dict[str, Any]], layer_map: LayerMap, *, fused: bool, every: int
) -> Any:
    """A :class:`~layercheck.workers.drift.hooks.StepHookProbe` on ``optimizer`` (built over
    ``groups``' params, in order), each parameter its own master, owned whole, in its group's layer."""
    from layercheck.workers.drift.hooks import StepHookProbe
    from layercheck.workers.layout import LayerLayout, Piece, StateLayout
    from layercheck.workers.shard import ParamSlice

    by_layer: dict[str, list[torch.Tensor]] = {}
    for group in groups:
        by_layer.setdefault(group["layer"], []).extend(group["params"])
    layers = {
        name: LayerLayout(
            name=name,
            owned=tuple(Piece(ParamSlice(f"{name}.{i}", tuple(p.shape), 0, p.numel()), p, 0) for i, p in enumerate(ps)),
            needed=(),
            masters=tuple(ps),
            groups=(),
        )
        for name, ps in by_layer.items()
    }
    layout = StateLayout(stage=0, rank=0, world_size=1, layers=layers, layer_map=layer_map, optimizer=optimizer)
    return StepHookProbe(layout, every=every, fused=fused)


#: The ``@N`` variants measure drift every N-th step (``policy.drift_every``, the default
#: schedule's 10); each call runs N steps and its time is reported per step.
SAMPLE_EVERY = 10


#: Kernel configurations ``--sweep`` times on CUDA: (BLOCK, NUM_WARPS, TRITON_CHUNK) of
#: :mod:`layercheck.workers.drift.triton_step`; the first is the default.
SWEEP: tuple[tuple[int, int, int], ...] = (
    (1024, 4, 1 << 14),
    (1024, 4, 1 << 16),
    (2048, 8, 1 << 16),
    (4096, 8, 1 << 16),
    (2048, 4, 1 << 15),
    (512, 4, 1 << 13),
)


def kernel_sweep(model: torch.nn.Module, device: str, steps: int) -> list[dict[str, Any]]:
    """The fused step under each :data:`SWEEP` configuration beside torch's fused AdamW: time per
    step, host issue time, and whether one step from the same state gives bit-equal parameters
    to the default configuration's (the configurations only change how work is split)."""
    from layercheck.workers.drift import fused_work as drift_fused_work
    from layercheck.workers.drift import triton_step as drift_triton
    from layercheck.workers.drift.adamw import DriftAdamW

    def configure(config: tuple[int, int, int]) -> None:
        drift_triton.BLOCK, drift_triton.NUM_WARPS, drift_fused_work.TRITON_CHUNK = config

    default = (drift_triton.BLOCK, drift_triton.NUM_WARPS, drift_fused_work.TRITON_CHUNK)
    fns: dict[str, Callable[[], None]] = {}
    issue: dict[str, Callable[[], None]] = {}
    equal: dict[str, bool] = {}
    first: list[torch.Tensor] = []
    try:
        torch.manual_seed(0)
        groups = _groups(model, device)
        adamw = torch.optim.AdamW(
            [{k: v for k, v in g.items() if k not in ("name", "layer")} for g in groups], lr=1e-5, fused=True
        )
        fns["adamw_fused"] = issue["adamw_fused"] = adamw.step
        for config in SWEEP:
            torch.manual_seed(0)
            optimizer = DriftAdamW(_groups(model, device), lr=1e-5, drift_step="fused")
            configure(config)
            optimizer.step()
            optimizer.take_drift()
            params = [p.detach() for g in optimizer.param_groups for p in g["params"]]
            if not first:
                first = [p.clone() for p in params]
            name = "x".join(map(str, config))
            equal[name] = all(torch.equal(a, b) for a, b in zip(first, params))

            def step(optimizer: DriftAdamW = optimizer, config: tuple[int, int, int] = config) -> None:
                configure(config)
                optimizer.step()
                torch.stack(list(optimizer.take_drift().values())).cpu()

            def issue_only(optimizer: DriftAdamW = optimizer, config: tuple[int, int, int] = config) -> None:
                configure(config)
                optimizer.step()

            fns[name], issue[name] = step, issue_only
        seconds = time_interleaved(fns, device, steps)
        issued = {name: issue_seconds(fn, device, steps) for name, fn in issue.items()}
    finally:
        configure(default)
    base = seconds["adamw_fused"]
    return [
        {
            "config": name,
            "seconds": seconds[name],
            "x_adamw_fused": seconds[name] / base,
            "issue_s": issued[name],
            "bit_equal_to_default": equal.get(name, None),
        }
        for name in fns
    ]


def training_step_seconds(preset: Preset) -> dict[str, float]:
    """Median seconds of one whole training step through the DeepSpeed engine (1 rank, ZeRO-0),
    per DriftAdamW ``drift_step``, interleaved on one engine (DeepSpeed builds one per process)."""
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

    def step_with(mode: str) -> Callable[[], None]:
        def step() -> None:
            train_engine.optimizer.drift_step = mode
            train_step(train_engine, [ids])

        return step

    seconds = time_interleaved({mode: step_with(mode) for mode in ("foreach", "fused")}, preset.device, preset.steps)
    shutdown(train_engine)
    return seconds


def run(preset_name: str, steps: int | None, device: str | None = None, sweep: bool = False) -> dict[str, Any]:
    from layercheck.workers.config import ModelConfig
    from layercheck.workers.engine import build_model

    preset = PRESETS[preset_name]
    if steps:
        preset = Preset(**{**preset.__dict__, "steps": steps})
    if device:
        preset = Preset(**{**preset.__dict__, "device": device})
    if preset.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"preset {preset_name} on cuda: torch.cuda.is_available() is False")
    model = build_model(ModelConfig(hf_config=preset.model))
    numel = sum(p.numel() for p in model.parameters())
    optimizer = time_interleaved(optimizer_variants(model, preset.device), preset.device, preset.steps)
    optimizer = {name: s / SAMPLE_EVERY if name.endswith(f"@{SAMPLE_EVERY}") else s for name, s in optimizer.items()}
    swept = kernel_sweep(model, preset.device, preset.steps) if sweep and preset.device == "cuda" else []
    del model
    wholes = training_step_seconds(preset)
    whole, whole_fused = wholes["foreach"], wholes["fused"]
    base = optimizer["adamw"]
    rows = {
        name: {
            "seconds": s,
            "x_adamw": s / base,
            "overhead_s": s - base,
            "vs_optimizer_step": (s - base) / base,
            "vs_training_step": (s - base) / whole,
        }
        for name, s in optimizer.items()
        if name != "adamw"
    }
    from layercheck.bench.machine import describe

    return {
        "preset": preset_name,
        "device": preset.device,
        "precision": preset.precision,
        "params": numel,
        "steps": preset.steps,
        "baseline": "torch AdamW fused=True" if preset.device == "cuda" else "torch AdamW foreach=True",
        "optimizer_step_s": base,
        "training_step_s": whole,
        "training_step_fused_s": whole_fused,
        "probes": rows,
        # the fused step against the plain one where both get new gradient tensors at every step
        "fused_x_adamw_new_grads": optimizer["drift_fused/new_grads"] / optimizer["adamw/new_grads"],
        "kernel_sweep": swept,
        "machine": describe(),
    }


def table(result: dict[str, Any]) -> str:
    lines = [
        f"{result['preset']} on {result['device']}: {result['params'] / 1e6:.2f}M params, "
        f"median of {result['steps']} steps",
        f"plain AdamW ({result['baseline']}) step {result['optimizer_step_s'] * 1e3:.3f} ms; whole training "
        f"step {result['training_step_s'] * 1e3:.3f} ms (drift_step=fused: {result['training_step_fused_s'] * 1e3:.3f} ms)",
        f"{'variant':<22} {'step ms':>10} {'x AdamW':>8} {'extra ms':>10} {'extra/train step':>17}",
    ]
    for name, row in result["probes"].items():
        lines.append(
            f"{name:<22} {row['seconds'] * 1e3:10.3f} {row['x_adamw']:8.3f} {row['overhead_s'] * 1e3:10.3f} "
            f"{row['vs_training_step']:17.4f}"
        )
    lines.append(
        f"with new gradient tensors at every step: drift_fused {result['fused_x_adamw_new_grads']:.3f}x "
        "plain AdamW's step"
    )
    if result.get("kernel_sweep"):
        lines.append(
            f"{'kernel (BLOCKxWARPSxCHUNK)':<26} {'step ms':>9} {'x fused':>8} {'issue ms':>9} {'bit-equal':>9}"
        )
        for row in result["kernel_sweep"]:
            lines.append(
                f"{row['config']:<26} {row['seconds'] * 1e3:9.3f} {row['x_adamw_fused']:8.3f} "
                f"{row['issue_s'] * 1e3:9.3f} {row['bit_equal_to_default']!s:>9}"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu-small")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per variant (after 3 warm-up)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None, help="override the preset's device")
    parser.add_argument(
        "--sweep",
        action="store_true",
        help="CUDA: also time the fused kernel's configurations (layercheck.workers.drift.triton_step)",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of the table")
    parser.add_argument("--out", default=None, help="also write the JSON to this file")
    args = parser.parse_args(argv)
    result = run(args.preset, args.steps, args.device, sweep=args.sweep)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
    print(json.dumps(result, indent=2) if args.json else table(result))


if __name__ == "__main__":
    main()
