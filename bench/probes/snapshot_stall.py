"""How long the training stream stalls for a persisted layer's snapshot: the side-stream copier
(:class:`layercheck.workers.snapshot_copy.SideStreamCopier`, CUDA) against the joined host copy it replaced,
side by side in one run, on a real DeepSpeed engine (one rank).

For each measured layer, interleaved (the machine drifts):

* ``step_s``     a training step (forward, backward, optimizer step) with no snapshot
* ``copy_s``     the layer's state (fp32 master, both Adam moments) copied device → pinned host
                 memory, joined: what a persisted layer costs to copy at all
* ``stall_side`` (snapshot on the side stream + the next training step) − ``step_s``
* ``stall_host`` (joined host copy + the next training step) − ``step_s``: the old path
* ``issue_side``  host seconds until the side-stream snapshot call returns (it should not wait)

With ``--profile``, one side-stream snapshot of the largest layer and the step after it run under
``torch.profiler``: the host calls that blocked longest (CUDA runtime calls, ``aten::item`` and
the like) are listed with their Python call sites, and the device-to-host copies with their times,
to name what the training stream waits for.

Target (issue 16): ``stall_side`` ≤ 1.2 × ``copy_s`` per persisted layer. On CPU the copier is
the host one (nothing to overlap with), so a CPU run only checks the plumbing.

    python bench/probes/snapshot_stall.py --preset h200-0.5b --out stall.json   # on a GPU machine
    python bench/probes/snapshot_stall.py --preset cpu-small --steps 3           # the plumbing, on CPU
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from functools import partial
from typing import Any

import torch

from layercheck.bench.drift_probe import PRESETS
from layercheck.bench.timing import timed

logger = logging.getLogger(__name__)


def _layers_to_measure(names: list[str]) -> list[str]:
    """The embedding (the largest layer), the first and middle blocks and the final norm."""
    blocks = [n for n in names if n.startswith("block.")]
    picked = [n for n in ("embed", blocks[0] if blocks else "", blocks[len(blocks) // 2] if blocks else "", "norm")]
    return list(dict.fromkeys(n for n in picked if n in names))


#: Host-side events that can block the training thread on the device, as torch's profiler names them.
BLOCKING = (
    "cudaStreamSynchronize",
    "cudaEventSynchronize",
    "cudaDeviceSynchronize",
    "cudaMemcpy",
    "cudaHostAlloc",
    "cudaMallocHost",
    "cudaFree",
    "cudaFreeHost",
    "cudaMalloc",
    "aten::item",
    "aten::_local_scalar_dense",
)


def blocking_calls(prof: Any, min_ms: float = 0.5, limit: int = 12) -> dict[str, Any]:
    """The host calls of a profile that took at least ``min_ms`` and can wait on the device, longest
    first, each with the innermost frames of its Python stack outside torch; and every device-to-host
    copy on the device with its start (ms from the first) and length."""
    events = list(prof.events())
    blocking, copies = [], []
    for e in events:
        ms = e.time_range.elapsed_us() / 1e3
        name = e.name
        if e.device_type.name == "CPU" and ms >= min_ms and name.startswith(BLOCKING):
            frames = [f for f in _callers(e) if "torch/" not in f and "<built-in" not in f]
            blocking.append({"name": name, "ms": round(ms, 3), "stack": frames[:6]})
        elif e.device_type.name == "CUDA" and "DtoH" in name:
            copies.append({"name": name, "start_us": e.time_range.start, "ms": round(ms, 3)})
    t0 = min((c["start_us"] for c in copies), default=0)
    for c in copies:
        c["start_ms"] = round((c.pop("start_us") - t0) / 1e3, 3)
    blocking.sort(key=lambda b: -b["ms"])
    long_copies = sorted(copies, key=lambda c: -c["ms"])[:limit]
    return {"blocking": blocking[:limit], "dtoh_copies": len(copies), "longest_dtoh": long_copies}


def _callers(event: Any) -> list[str]:
    """The names of an event's enclosing events, innermost first: with ``with_stack`` these
    include the Python frames (``file.py(line): function``) it was called from."""
    names = []
    parent = event.cpu_parent
    while parent is not None:
        names.append(parent.name)
        parent = parent.cpu_parent
    return names


def stall_job(
    rank: int,
    world_size: int,
    preset_name: str,
    steps: int,
    zero_stage: int,
    profile: bool = False,
) -> dict[str, Any]:
    """Rank 0 of a one-rank group: build the preset's engine and time the three paths per layer."""
    from layercheck.workers.config import EngineConfig, ModelConfig, OptimConfig
    from layercheck.workers.engine import build_engine, shutdown
    from layercheck.workers.host_buffers import HostBufferPool
    from layercheck.workers.snapshot_copy import Handover, HostCopier, copier_for
    from layercheck.workers.step import train_step

    preset = PRESETS[preset_name]
    train_engine = build_engine(
        ModelConfig(hf_config=preset.model, seed=0),
        OptimConfig(lr=1e-5, warmup_steps=1, total_steps=10_000),
        EngineConfig(zero_stage=zero_stage, precision=preset.precision, micro_batch=preset.micro_batch, grad_clip=1.0),
    )
    g = torch.Generator().manual_seed(0)
    batch = torch.randint(0, int(preset.model["vocab_size"]), (preset.micro_batch, preset.seq), generator=g)

    def step() -> None:
        train_step(train_engine, [batch])

    layout = train_engine.layout
    pool = HostBufferPool()
    side = copier_for(layout)
    host = HostCopier(layout)
    sides = Handover(side, lambda shards, base: None, pool, max_in_flight=1)
    hosts = Handover(host, lambda shards, base: None, pool, max_in_flight=1)

    def copy_only(layer: str) -> None:
        for shard in host.copy([layer], train_engine.step, pool)[0]:
            pool.release(shard)

    issued: list[float] = []

    def snapshot_then_step(handover: Handover, layer: str) -> None:
        start = time.perf_counter()
        handover.take([layer], train_engine.step, base=False)
        issued.append(time.perf_counter() - start)
        step()

    for _ in range(3):
        step()

    device = str(train_engine.engine.device)
    rows = []
    names = _layers_to_measure(list(train_engine.layer_map.names))
    for name in names:
        numel = layout[name].owned_numel
        samples: dict[str, list[float]] = {k: [] for k in ("step", "copy", "side", "host", "issue")}
        for i in range(steps + 1):  # the first round warms the pinned buffers up; not counted
            copy_s = timed(partial(copy_only, name), device)
            step_s = timed(step, device)
            issued.clear()
            side_s = timed(partial(snapshot_then_step, sides, name), device)
            sides.flush(wait=True)
            host_s = timed(partial(snapshot_then_step, hosts, name), device)
            hosts.flush(wait=True)
            if i:
                measured = {"copy": copy_s, "step": step_s, "side": side_s, "host": host_s}
                for key, value in (*measured.items(), ("issue", issued[0])):
                    samples[key].append(value)
        median = {key: statistics.median(values) for key, values in samples.items()}
        rows.append(
            {
                "layer": name,
                "bytes": numel * 12,
                "copy_s": median["copy"],
                "copy_gbps": numel * 12 / median["copy"] / 1e9,
                "step_s": median["step"],
                "stall_side_s": max(0.0, median["side"] - median["step"]),
                "stall_host_s": max(0.0, median["host"] - median["step"]),
                "issue_side_s": median["issue"],
            }
        )
    profiled = None
    if profile and names and device.startswith("cuda"):
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as torch_profile

        largest = max(names, key=lambda n: layout[n].owned_numel)
        timed(step, device)
        with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as prof:
            timed(partial(snapshot_then_step, sides, largest), device)
        sides.flush(wait=True)
        profiled = {"layer": largest, **blocking_calls(prof)}
    side.close()
    out = {
        "preset": preset_name,
        "zero_stage": zero_stage,
        "copier": type(side).__name__,
        "device": device,
        "steps": steps,
        "layers": rows,
        "profile": profiled,
    }
    shutdown(train_engine)
    return out


def _table(result: dict[str, Any]) -> str:
    lines = [
        f"snapshot stall, {result['preset']} ZeRO-{result['zero_stage']} on {result['device']} ({result['copier']}); "
        f"medians of {result['steps']}",
        f"{'layer':<10} {'MB':>8} {'copy ms':>8} {'GB/s':>6} {'step ms':>8} {'side stall':>11} {'host stall':>11} "
        f"{'issue ms':>8} {'side/copy':>9}",
    ]
    for r in result["layers"]:
        ratio = r["stall_side_s"] / r["copy_s"] if r["copy_s"] else float("nan")
        lines.append(
            f"{r['layer']:<10} {r['bytes'] / 1e6:>8.1f} {r['copy_s'] * 1e3:>8.2f} {r['copy_gbps']:>6.1f} "
            f"{r['step_s'] * 1e3:>8.2f} {r['stall_side_s'] * 1e3:>9.2f}ms {r['stall_host_s'] * 1e3:>9.2f}ms "
            f"{r['issue_side_s'] * 1e3:>8.2f} {ratio:>9.2f}"
        )
    found = result.get("profile")
    if found:
        lines.append(
            f"profile ({found['layer']}): {found['dtoh_copies']} device-to-host copies; host calls that blocked:"
        )
        for call in found["blocking"]:
            lines.append(f"  {call['ms']:>8.2f} ms  {call['name']}  at {' <- '.join(call['stack'][:3])}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu-small")
    parser.add_argument("--steps", type=int, default=8, help="timed rounds per layer (medians)")
    parser.add_argument("--zero-stage", type=int, choices=(1, 2, 3), default=3)
    parser.add_argument("--profile", action="store_true", help="profile one snapshot of the largest layer (CUDA)")
    parser.add_argument("--out", help="write the JSON here")
    args = parser.parse_args(argv)
    from layercheck.orchestrator.local.spawn import spawn_ranks

    (result,) = spawn_ranks(stall_job, 1, args.preset, args.steps, args.zero_stage, args.profile, what="snapshot stall")
    print(json.dumps(result, indent=2))
    print(_table(result))
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
