"""Recovery load time from the writers' memory against from storage, on an S3-compatible server.

    python -m layercheck.bench.memory_tier [--layers 6] [--params 2000000] [--world 2] [--repeats 3] [--json]

A real persistence writer actor (local Ray) writes every rank's shard of one version of each
layer to an S3 bucket on a moto server on loopback (a separate process), keeping the files in
its memory as a run's writers do. The composite is then read back as a recovering rank does
(``CompositeReader`` over all layers: every state of every parameter, checksums verified):

* ``storage``: the store alone (``persistence.memory_bytes = 0``);
* ``memory``: through the recovery's memory-first opener, the files fetched from the writer
  actor (``WriterCopies`` + ``MemoryFirstOpener``, what ``train_fn.recover`` uses).

Prints a table and, with ``--json``, one JSON object: seconds per repeat and the ratio of the
medians (the target: memory ≤ 0.3 × storage).
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
from layercheck.orchestrator.core.memory_reads import MemoryFirstOpener
from layercheck.orchestrator.runtime.memory_fetch import WriterCopies
from layercheck.orchestrator.runtime.wire import to_wire
from layercheck.orchestrator.runtime.writer_actor import PersistenceWriter
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


def _load_all(store: LayerStore, records: dict[str, Any], params: int) -> float:
    started = time.monotonic()
    with CompositeReader(store, records) as read:
        for layer in records:
            for key in STATE_KEYS:
                read(f"{layer}.w", key, 0, params)
    return time.monotonic() - started


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
    writer = PersistenceWriter.remote(uri, False, sink, "bench-writer", None, None, 8 * 2**30)  # type: ignore[attr-defined]
    names = [f"block.{i}" for i in range(layers)]
    ray.get([writer.submit.remote(to_wire(s, base=False)) for name in names for s in _shards(name, params, world)])
    store = LayerStore.open(uri, fsync=False)
    receipts = [ShardReceipt.from_json(r) for r in ray.get(sink.get.remote())]
    records = {
        name: store.commit(sorted((r for r in receipts if r.layer == name), key=lambda r: r.rank)) for name in names
    }
    index = {path: [("memory_local", writer)] for path, _ in ray.get(writer.held.remote())}
    storage_s, memory_s, sources = [], [], None
    for _ in range(repeats):
        storage_s.append(_load_all(LayerStore.open(uri, fsync=False), records, params))
        paths = [e.path for record in records.values() for e in record.shards]
        copies = WriterCopies(index, prefetch=paths)
        opener = MemoryFirstOpener(candidates=copies, open_storage=store.fs.open_input)
        memory_s.append(_load_all(LayerStore(store.fs, opener=opener), records, params))
        sources = opener.sources
    nbytes = sum(r.nbytes for r in receipts)
    return {
        "layers": layers,
        "params_per_layer": params,
        "world_size": world,
        "composite_bytes": nbytes,
        "storage_s": storage_s,
        "memory_s": memory_s,
        "ratio": statistics.median(memory_s) / statistics.median(storage_s),
        "memory_sources": sources.to_json() if sources is not None else {},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m layercheck.bench.memory_tier", description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--params", type=int, default=2_000_000, help="parameters per layer")
    parser.add_argument("--world", type=int, default=2, help="ranks the shards were written by")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    result = run(layers=args.layers, params=args.params, world=args.world, repeats=args.repeats)
    print(
        format_table(
            ["load the composite from", "median s", "each repeat (s)"],
            [
                ["S3 on loopback (moto)", f"{statistics.median(result['storage_s']):.3f}", _each(result["storage_s"])],
                [
                    "writer memory (Ray actor)",
                    f"{statistics.median(result['memory_s']):.3f}",
                    _each(result["memory_s"]),
                ],
            ],
        )
    )
    print(
        f"composite {human_bytes(result['composite_bytes'])} ({args.layers} layers x {args.world} shards); "
        f"memory / storage = {result['ratio']:.3f}"
    )
    if args.json:
        print(json.dumps(result))
    return 0


def _each(values: list[float]) -> str:
    return ", ".join(f"{v:.3f}" for v in values)


if __name__ == "__main__":
    sys.exit(main())
