"""The fused drift step's host time: what ``DriftAdamW(drift_step="fused").step()`` spends in
Python before its one kernel launch, measured on any machine.

On a GPU that time comes before the launch, so the GPU waits it out (the H200 run of 2026-12-04:
~6 ms of a 9.6 ms step, ``bench/results/gpu-2026-12-04-NVIDIA-H200``). It does not depend on
the tensors' sizes, only on their number and grouping, so this benchmark builds the 0.5B shape's
structure (290 tensors in 50 layer groups) from tiny CPU tensors and replaces the launch with a
no-op: the figure is the step's bookkeeping (step counts, groups, the kernel's tables; what
DriftAdamW keeps of them from step to step is checked, not rebuilt), nothing of the update. It is
timed twice: with the gradients kept from step to step (DeepSpeed's flat ZeRO 1-3 buffers), and
with new gradient tensors at every step (a loop that sets them to ``None``, DeepSpeed's fp32 copies
of bf16 ones), where the kernel's address table is built anew and the new gradients are checked
for the kernel (:func:`~layercheck.workers.drift.fused.kernel_takes`: the test it makes of CUDA
tensors, here of CPU ones).

    python bench/probes/fused_issue.py                 # the table
    python bench/probes/fused_issue.py --json --steps 100
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import statistics
import sys
import time
import types
from collections.abc import Iterator
from typing import Any

import torch

BLOCKS = 24  # Qwen2.5-0.5B: 24 blocks of 7 matrices (decay) and 5 vectors (no decay), embed, norm


class _NoLaunch:
    """Stands in for the Triton kernel: ``kernel[grid](...)`` does nothing."""

    def __getitem__(self, grid: Any) -> Any:
        return lambda *args, **kwargs: None


@contextlib.contextmanager
def _kernel_launching_nothing() -> Iterator[None]:
    """:mod:`layercheck.workers.drift.triton_step` with its kernel replaced and every tensor taken as
    the kernel's; where Triton is not installed, against a stand-in module (torch's dynamo probes
    Triton at import: it goes first). Everything is put back on the way out."""
    from layercheck.workers.drift import fused as drift_fused

    added = []
    if importlib.util.find_spec("triton") is None:
        import torch._dynamo  # noqa: F401

        language = types.ModuleType("triton.language")
        language.constexpr = object  # type: ignore[attr-defined]
        triton = types.ModuleType("triton")
        triton.language = language  # type: ignore[attr-defined]
        triton.jit = lambda fn: _NoLaunch()  # type: ignore[attr-defined]
        for name, module in (("triton", triton), ("triton.language", language)):
            sys.modules[name] = module
            added.append(name)
        added.append("layercheck.workers.drift.triton_step")
    from layercheck.workers.drift import triton_step as drift_triton

    kernel, eligible = drift_triton._adamw_l1_kernel, drift_fused.triton_eligible
    drift_triton._adamw_l1_kernel = _NoLaunch()
    drift_fused.triton_eligible = drift_fused.kernel_takes  # (as for CUDA tensors, less the device's kind)
    try:
        yield
    finally:
        drift_triton._adamw_l1_kernel, drift_fused.triton_eligible = kernel, eligible
        for name in added:
            sys.modules.pop(name, None)
        if added:  # the stand-in's kernel module must not outlive it
            import layercheck.workers.drift

            delattr(layercheck.workers.drift, "triton_step")


def _groups() -> list[dict[str, Any]]:
    def tensor() -> torch.nn.Parameter:
        return torch.nn.Parameter(torch.randn(64))

    groups = [{"name": "embed", "params": [tensor()], "weight_decay": 0.0}]
    for b in range(BLOCKS):
        groups.append({"name": f"block.{b}", "params": [tensor() for _ in range(7)], "weight_decay": 0.1})
        groups.append({"name": f"block.{b}/no_decay", "params": [tensor() for _ in range(5)], "weight_decay": 0.0})
    groups.append({"name": "norm", "params": [tensor()], "weight_decay": 0.0})
    return groups


def run(steps: int) -> dict[str, Any]:
    """The step's host time with its gradients kept (``host_s``) and with new ones at every step
    (``host_new_grads_s``), medians and 90th percentiles over ``steps`` after 20 warm-up steps."""
    from layercheck.workers.drift.adamw import DriftAdamW

    groups = _groups()
    params = [p for group in groups for p in group["params"]]
    out: dict[str, Any] = {"tensors": len(params), "groups": len(groups), "steps": steps}
    with _kernel_launching_nothing():
        for name, sets in (("host", 1), ("host_new_grads", 2)):
            optimizer = DriftAdamW(groups, lr=1e-5, drift_step="fused")
            grads = [[torch.randn_like(p) for p in params] for _ in range(sets)]
            samples = []
            for i in range(20 + steps):
                for p, grad in zip(params, grads[i % sets]):  # (the same tensors, or the other set's)
                    p.grad = grad
                start = time.perf_counter()
                optimizer.step()
                optimizer.take_drift()
                if i >= 20:
                    samples.append(time.perf_counter() - start)
            out[f"{name}_s"] = statistics.median(samples)
            out[f"{name}_s_p90"] = statistics.quantiles(samples, n=10)[-1]
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300, help="timed steps (after 20 warm-up)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of the table")
    args = parser.parse_args(argv)
    result = run(args.steps)
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"fused drift step, host time before its launch: {result['tensors']} tensors in {result['groups']} groups")
    for name, label in (("host", "gradients kept"), ("host_new_grads", "new gradients each step")):
        print(
            f"{label:<24} median {result[f'{name}_s'] * 1e3:.3f} ms, p90 {result[f'{name}_s_p90'] * 1e3:.3f} ms "
            f"over {result['steps']} steps"
        )


if __name__ == "__main__":
    main()
