"""Recovery load time from the writers' memory against from storage, on an S3-compatible server.

    python bench/probes/memory_tier.py [--layers 6] [--params 2000000] [--world 2] [--repeats 3] [--json]

A real persistence writer actor (local Ray) writes every rank's shard of one version of each
layer to an S3 bucket on a moto server on loopback (a separate process), keeping the files in
its memory as a run's writers do. The composite is then read back as the recovering ranks do at
the world size it was written at: each rank reads its own slices of every layer (every state,
checksums verified) through ``CompositeReader``, one rank after the other:

* ``storage``: the store alone (``persistence.memory_bytes = 0``);
* ``memory``: through the recovery's memory-first opener, the headers of every file and the files
  holding the rank's slices fetched from the writer actor (``memory_fetch.memory_first_store``'s
  steps: ``WriterCopies.headers``, ``files_to_fetch``, ``WriterCopies.prefetch``).

Prints a table and, with ``--json``, one JSON object: per tier, seconds per repeat (all ranks),
the bytes read (all ranks) over the composite's, and the load bandwidth; and the ratio of the
medians (the targets: memory ≤ 0.3 × storage, bytes read ≤ 1.1 × the composite, ≥ 1 GB/s from
memory).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import ray
import torch

from layercheck.bench.s3_loopback import S3_ENV, loopback_s3
from layercheck.orchestrator.core.memory.reads import MemoryFirstOpener, files_to_fetch
from layercheck.orchestrator.runtime.memory_fetch import WriterCopies
from layercheck.orchestrator.runtime.wire import to_wire
from layercheck.orchestrator.runtime.writer_actor import WriterActor
from layercheck.orchestrator.store.composite_reader import CompositeReader
from layercheck.orchestrator.store.layer_store import LayerStore
from layercheck.orchestrator.store.manifest import ShardReceipt
from layercheck.orchestrator.table import format_table, human_bytes
from layercheck.workers.shard import STATE_KEYS, LayerShard, ParamSlice

BUCKET = "layercheck-bench"


@ray.remote(num_cpus=0)
class _Receipts:
    """Stands in for the supervisor: keeps the receipts the writer hands over."""

    def __init__(self) -> None:
        self.receipts: list[dict[str, Any]] = []

    def shard_written(self, receipt: dict[str, Any], write_s: float) -> None:
        self.receipts.append(receipt)

    def write_failed(self, layer: str, step: int, rank: int, error: str) -> None:
        raise RuntimeError(f"bench write of {layer}@{step} rank {rank} failed: {error}")

    def get(self) -> list[dict[str, Any]]:
        return self.receipts


def _shards(layer: str, params: int, world: int) -> list[LayerShard]:
    gen = torch.Generator().manual_seed(hash(layer) % 2**31)
    full = {key: torch.randn(params, generator=gen) for key in STATE_KEYS}
    cuts = [params * r // world for r in range(world + 1)]
    return [
        LayerShard(
            layer=layer,
            step=10,
            rank=r,
            world_size=world,
            slices=(ParamSlice(name=f"{layer}.w", shape=(params,), offset=cuts[r], length=cuts[r + 1] - cuts[r]),),
            tensors={key: full[key][cuts[r] : cuts[r + 1]].clone() for key in STATE_KEYS},
            optimizer_step=10,
            groups=({"lr": 1e-3},),
        )
        for r in range(world)
    ]


def _load_rank(store: LayerStore, records: dict[str, Any], params: int, rank: int, world: int) -> float:
    """Rank ``rank``'s slices of every layer, every state, as a recovering rank reads them."""
    start, end = params * rank // world, params * (rank + 1) // world
    started = time.monotonic()
    with CompositeReader(store, records) as read:
        for layer in records:
            for key in STATE_KEYS:
                read(f"{layer}.w", key, start, end - start)
    return time.monotonic() - started


def _rank_needs(records: dict[str, Any], params: int, rank: int, world: int) -> dict[str, list[tuple[int, int]]]:
    start, end = params * rank // world, params * (rank + 1) // world
    return {f"{layer}.w": [(start, end)] for layer in records}


def run(*, layers: int, params: int, world: int, repeats: int) -> dict[str, Any]:
    with loopback_s3(BUCKET) as s3:
        uri = s3.uri("run")
        try:
            ray.init(num_cpus=2, include_dashboard=False, runtime_env={"env_vars": S3_ENV}, log_to_driver=False)
            return _measure(uri, layers=layers, params=params, world=world, repeats=repeats)
        finally:
            if ray.is_initialized():
                ray.shutdown()


def _measure(uri: str, *, layers: int, params: int, world: int, repeats: int) -> dict[str, Any]:
    # both are @ray.remote classes, which mypy types as the class itself (python/mypy#3135)
    sink = _Receipts.remote()  # type: ignore[attr-defined]
    writer = WriterActor.remote(uri, False, sink, "bench-writer", None, 8 * 2**30)  # type: ignore[attr-defined]
    names = [f"block.{i}" for i in range(layers)]
    ray.get([writer.submit.remote(to_wire(s, base=False)) for name in names for s in _shards(name, params, world)])
    store = LayerStore.open(uri, fsync=False)
    receipts = [ShardReceipt.from_json(r) for r in ray.get(sink.get.remote())]
    records = {
        name: store.commit(sorted((r for r in receipts if r.layer == name), key=lambda r: r.rank)) for name in names
    }
    index = {path: [("memory_local", writer)] for path, _ in ray.get(writer.held.remote())}
    paths = [e.path for record in records.values() for e in record.shards]
    nbytes = sum(r.nbytes for r in receipts)
    tiers: dict[str, dict[str, Any]] = {
        "storage": {"seconds": [], "read_bytes": 0},
        "memory": {"seconds": [], "read_bytes": 0},
    }
    for _ in range(repeats):
        for name in tiers:
            seconds, read_bytes = 0.0, 0
            for rank in range(world):
                started = time.monotonic()
                if name == "storage":
                    opener = MemoryFirstOpener(candidates=lambda path: (), open_storage=store.fs.open_input)
                else:  # what memory_fetch.memory_first_store does for a rank
                    copies = WriterCopies(index)
                    headers = copies.headers(paths)
                    copies.prefetch(files_to_fetch(headers, _rank_needs(records, params, rank, world)))
                    opener = MemoryFirstOpener(candidates=copies, open_storage=store.fs.open_input, headers=headers)
                _load_rank(LayerStore(store.fs, opener=opener), records, params, rank, world)
                seconds += time.monotonic() - started
                sources = opener.sources
                read_bytes = sources.memory_local_bytes + sources.memory_remote_bytes + sources.storage_bytes
            tiers[name]["seconds"].append(seconds)
            tiers[name]["read_bytes"] = read_bytes * world  # (the last rank's, times the ranks: all alike)
    for tier in tiers.values():
        tier["read_vs_composite"] = tier["read_bytes"] / nbytes
        tier["gb_per_s"] = tier["read_bytes"] / statistics.median(tier["seconds"]) / 1e9
    return {
        "layers": layers,
        "params_per_layer": params,
        "world_size": world,
        "composite_bytes": nbytes,
        "tiers": tiers,
        "storage_s": tiers["storage"]["seconds"],
        "memory_s": tiers["memory"]["seconds"],
        "ratio": statistics.median(tiers["memory"]["seconds"]) / statistics.median(tiers["storage"]["seconds"]),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python bench/probes/memory_tier.py", description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--params", type=int, default=2_000_000, help="parameters per layer")
    parser.add_argument("--world", type=int, default=2, help="ranks the shards were written by")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    result = run(layers=args.layers, params=args.params, world=args.world, repeats=args.repeats)
    labels = {"storage": "S3 on loopback (moto)", "memory": "writer memory (Ray actor)"}
    rows = [
        [
            labels[name],
            f"{statistics.median(tier['seconds']):.3f}",
            _each(tier["seconds"]),
            human_bytes(tier["read_bytes"]),
            f"{tier['read_vs_composite']:.3f}x",
            f"{tier['gb_per_s']:.2f}",
        ]
        for name, tier in result["tiers"].items()
    ]
    print(
        format_table(["load the composite from", "median s", "each repeat (s)", "read", "read/composite", "GB/s"], rows)
    )
    print(
        f"composite {human_bytes(result['composite_bytes'])} ({args.layers} layers x {args.world} shards), read by "
        f"{args.world} ranks each reading its own slices; memory / storage = {result['ratio']:.3f}"
    )
    if args.json:
        print(json.dumps(result))
    return 0


def _each(values: list[float]) -> str:
    return ", ".join(f"{v:.3f}" for v in values)


if __name__ == "__main__":
    sys.exit(main())
