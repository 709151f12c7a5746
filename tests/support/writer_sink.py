"""What a writer actor reports its writes to, for the tests that drive a real ``WriterActor``
without a supervisor: a Ray actor that takes each receipt and raises on a failed write."""

from __future__ import annotations

from typing import Any


def receipts_sink() -> Any:
    """A started actor with the supervisor's two receipt methods a writer calls."""
    import ray

    @ray.remote(num_cpus=0)
    class Receipts:
        def shard_written(self, receipt: Any, write_s: float) -> None:
            pass

        def write_failed(self, layer: str, step: int, rank: int, error: str) -> None:
            raise RuntimeError(error)

    return Receipts.remote()
