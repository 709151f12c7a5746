"""Micro-benchmark: how long a survivor's capture takes per GB, the figure the capture window
(``persistence.capture_timeout_s``, :mod:`layercheck.orchestrator.core.recovery.capture_window`) must cover.

One rank (gloo, world size 1, ZeRO-0 so it holds the whole model) trains a step of a model built
from a transformers config, then, ``--repeats`` times:

* ``copy``      ``layercheck.workers.capture.capture_shards``: every layer's fp32 weights and both Adam
                moments copied out of the optimizer into host buffers;
* ``handover``  what ``RayCoordinator._capture`` does next: ``ray.put`` of each layer's shard and a
                writer actor's ``hold`` (the writer copies it into its own memory and answers; the
                write to storage happens after, off the clock), against a real local Ray.

    python bench/probes/capture_rate.py                    # ~0.5 GB of state
    python bench/probes/capture_rate.py --hidden 1536      # bigger
    python bench/probes/capture_rate.py --json
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from typing import TYPE_CHECKING, Any

from layercheck.orchestrator.local.spawn import spawn_ranks
from layercheck.orchestrator.table import format_table

if TYPE_CHECKING:
    from layercheck.orchestrator.core.run_config import RunConfig


def _config(hidden: int, layers: int) -> RunConfig:
    from layercheck.orchestrator.core.run_config import ClusterConfig, RunConfig
    from layercheck.workers.config import EngineConfig, ModelConfig, OptimConfig

    hf = {
        "model_type": "llama",
        "vocab_size": 256,
        "hidden_size": hidden,
        "intermediate_size": 4 * hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": max(1, hidden // 64),
        "num_key_value_heads": max(1, hidden // 64),
        "max_position_embeddings": 64,
    }
    return RunConfig(
        name="capture-rate",
        steps=1,
        model=ModelConfig(hf_config=hf, seed=0),
        optim=OptimConfig(lr=1e-4, warmup_steps=0, total_steps=10),
        engine=EngineConfig(zero_stage=0, precision="fp32", micro_batch=1),
        cluster=ClusterConfig(num_workers=1),
    )


def _receipts_sink() -> Any:
    """Stands in for the run's supervisor, to which a writer reports each write: takes the receipts."""
    import ray

    @ray.remote(num_cpus=0)
    class ReceiptsSink:
        def shard_written(self, receipt: Any, write_s: float) -> None:
            pass

        def write_failed(self, *args: Any) -> None:
            pass

    return ReceiptsSink.remote()  # type: ignore[attr-defined]  # @ray.remote class (python/mypy#3135)


def _rank(rank: int, world_size: int, hidden: int, layers: int, repeats: int) -> dict[str, Any]:
    import ray
    import torch

    from layercheck.orchestrator.runtime.wire import to_wire
    from layercheck.orchestrator.runtime.writer_actor import WriterActor
    from layercheck.workers.capture import capture_shards
    from layercheck.workers.engine import build_engine, shutdown
    from layercheck.workers.host_buffers import HostBufferPool
    from layercheck.workers.step import train_step

    config = _config(hidden, layers)
    train_engine = build_engine(config.model, config.optim, config.engine)
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        train_step(train_engine, [torch.randint(0, 256, (1, 32))])
        pool = HostBufferPool()
        with tempfile.TemporaryDirectory() as store:
            writer = WriterActor.remote(store, False, _receipts_sink())  # type: ignore[attr-defined]  # @ray.remote class (python/mypy#3135)
            copy_s, handover_s, nbytes = [], [], 0
            for _ in range(repeats):
                started = time.perf_counter()
                shards = capture_shards(train_engine.layout, 1, pool)
                copied = time.perf_counter()
                refs = [writer.hold.remote(ray.put(to_wire(s, base=False, origin="capture"))) for s in shards]
                nbytes = sum(ray.get(refs))
                copy_s.append(copied - started)
                handover_s.append(time.perf_counter() - copied)
                for shard in shards:
                    pool.release(shard)
                ray.get(writer.drain.remote(), timeout=600)  # not timed: the writes after the hold
    finally:
        ray.shutdown()
        shutdown(train_engine)
    return {"bytes": nbytes, "copy_s": copy_s, "handover_s": handover_s}


def measure(*, hidden: int, layers: int, repeats: int) -> dict[str, Any]:
    (raw,) = spawn_ranks(_rank, 1, hidden, layers, repeats, timeout_s=1800, what="capture rate")
    gb = raw["bytes"] / 1e9
    copy, handover = statistics.median(raw["copy_s"]), statistics.median(raw["handover_s"])
    return {
        "model": {"hidden": hidden, "layers": layers},
        "state_bytes": raw["bytes"],
        "repeats": repeats,
        "copy_s": copy,
        "handover_s": handover,
        "capture_s": copy + handover,
        "seconds_per_gb": (copy + handover) / gb,
        "copy_gb_per_s": gb / copy,
        "handover_gb_per_s": gb / handover,
        "runs": raw,
    }


def table(result: dict[str, Any]) -> str:
    rows = [
        ["state captured", f"{result['state_bytes'] / 1e9:.2f} GB (fp32 weights + both Adam moments)"],
        ["copy out of the optimizer", f"{result['copy_s']:.3f} s ({result['copy_gb_per_s']:.2f} GB/s)"],
        ["hand-over (ray.put + writer hold)", f"{result['handover_s']:.3f} s ({result['handover_gb_per_s']:.2f} GB/s)"],
        ["capture, per GB", f"{result['seconds_per_gb']:.2f} s"],
    ]
    return format_table([f"capture (median of {result['repeats']})", ""], rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    result = measure(hidden=args.hidden, layers=args.layers, repeats=args.repeats)
    print(json.dumps(result, indent=2) if args.json else table(result))


if __name__ == "__main__":
    main()
