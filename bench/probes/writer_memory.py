"""A persistence writer actor's resident memory against what it says it holds.

    python bench/probes/writer_memory.py [--layers 32] [--shard-mb 25] [--ranks 2] [--budget-mb 2048]
                                         [--periods 4] [--origin memory|policy] [--json]

A real writer actor (local Ray, an object store of ``--object-store-mb``) takes ``--periods``
versions of every layer from ``--ranks`` ranks as a run's ranks hand them over (``ray.put``, then
``submit``): memory versions (``persistence.memory_period``, held only) or stored versions
(written to a temporary store, and held), within a ``--budget-mb`` in-memory tier. After each
period it prints the writer's account (``WriterStats.host``: runtime, held by kind, in flight) beside
its process's resident memory from ``/proc`` (own = anon + file; the object store's shared pages
apart) and what is not accounted for. The defaults are a 135M-parameter model's state (1.6 GB of
fp32 weights and Adam moments over 2 ranks) under the default 2 GiB budget.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import ray
import torch

from layercheck.orchestrator.core.memory.footprint import process_memory
from layercheck.orchestrator.runtime.wire import to_wire
from layercheck.orchestrator.runtime.writer_actor import WriterActor
from layercheck.orchestrator.table import format_table, human_bytes
from layercheck.workers.shard import STATE_KEYS, LayerShard, ParamSlice


@ray.remote(num_cpus=0)
class _Receipts:
    """Stands in for the supervisor: takes the writer's receipts."""

    def shard_written(self, receipt: Any, write_s: float) -> None:
        pass

    def write_failed(self, layer: str, step: int, rank: int, error: str) -> None:
        raise RuntimeError(error)


def _shard(layer: int, step: int, rank: int, ranks: int, numel: int) -> LayerShard:
    gen = torch.Generator().manual_seed(step * 1000 + layer * 10 + rank)
    return LayerShard(
        layer=f"block.{layer}",
        step=step,
        rank=rank,
        world_size=ranks,
        slices=(ParamSlice(name="w", shape=(numel * ranks,), offset=rank * numel, length=numel),),
        tensors={key: torch.randn(numel, generator=gen) for key in STATE_KEYS},
        optimizer_step=step,
        groups=({"name": f"block.{layer}", "lr": 1e-5, "params": ["w"]},),
    )


def _pid(writer: Any) -> int:
    return int(ray.get(writer.__ray_call__.remote(lambda _self: os.getpid())))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--shard-mb", type=float, default=25.0, help="one rank's shard of a layer, MB")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--budget-mb", type=int, default=2048, help="persistence.memory_bytes, MiB")
    parser.add_argument("--periods", type=int, default=4)
    parser.add_argument("--origin", choices=("memory", "policy"), default="memory")
    parser.add_argument("--object-store-mb", type=int, default=5120)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    ray.init(num_cpus=2, object_store_memory=args.object_store_mb * 2**20, include_dashboard=False)
    numel = int(args.shard_mb * 1e6 / (4 * len(STATE_KEYS)))
    rows, out = [], []
    with tempfile.TemporaryDirectory(prefix="writer-memory-") as tmp:
        sink = _Receipts.remote()  # type: ignore[attr-defined]
        writer = WriterActor.remote(f"{tmp}/run", False, sink, "probe", None, args.budget_mb * 2**20)  # type: ignore[attr-defined]
        pid = _pid(writer)
        for period in range(1, args.periods + 1):
            started = time.monotonic()
            results = ray.get(
                [
                    writer.submit.remote(
                        ray.put(to_wire(_shard(layer, period, rank, args.ranks, numel), base=False, origin=args.origin))
                    )
                    for layer in range(args.layers)
                    for rank in range(args.ranks)
                ]
            )
            ray.get(writer.drain.remote())
            seconds = time.monotonic() - started
            host = ray.get(writer.get_stats.remote()).host
            process = process_memory(Path(f"/proc/{pid}/status"))
            view = host.to_json() if host is not None else {}
            out.append({"period": period, "seconds": seconds, "written": results.count("written"), **view})
            held = view.get("memory_version_bytes", 0) + view.get("stored_copy_bytes", 0) + view.get("mirror_bytes", 0)
            rows.append(
                [
                    period,
                    f"{seconds:.1f}",
                    human_bytes(view.get("runtime_bytes", 0)),
                    human_bytes(held),
                    human_bytes(view.get("own_bytes") or 0),
                    human_bytes(view.get("unaccounted_bytes") or 0),
                    human_bytes(view.get("peak_unaccounted_bytes") or 0),
                    human_bytes(process.shmem_bytes if process else 0),
                    human_bytes(process.rss_bytes if process else 0),
                ]
            )
        for actor in (writer, sink):
            ray.kill(actor)
    ray.shutdown()
    if args.json:
        print(json.dumps(out, indent=1))
    else:
        header = ["period", "s", "runtime", "held", "own RSS", "unaccounted", "peak unacc.", "object store", "RSS"]
        print(format_table(header, rows))


if __name__ == "__main__":
    main()
