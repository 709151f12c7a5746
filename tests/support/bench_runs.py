"""The benchmark harness run the harness smoke test and the capture test share."""

from __future__ import annotations

from pathlib import Path
from typing import Any

#: Its strategies (``none`` runs first, the reference).
TINY_BENCHMARK_STRATEGIES = [
    "layercheck",
    "layercheck+capture",
    "layercheck+capture+memory",
    "layercheck+capture+memory@3",
    "full",
    "diff",
    "full-resume",
]


def tiny_benchmark_run(partial: Path) -> tuple[Any, dict[str, Any], Path]:
    """One run of the benchmark harness on real DeepSpeed ranks (the tiny preset: 2 ranks, 8 steps,
    the last rank lost after step 6; local stores, deleted after) of every strategy in
    ``TINY_BENCHMARK_STRATEGIES``: (workload, raw results, ``partial``, the results so far as
    rewritten after each strategy). The strategies run in turn from the same initial state, so
    each one's results are what a run of it alone gives."""
    from layercheck.bench.harness import run_benchmark
    from layercheck.bench.presets import preset
    from layercheck.bench.strategies import default_strategies, select

    workload = preset("tiny", steps=8, failures=(6,), interval=4, layercheck_warmup=2, lr_warmup=2, memory_period=3)
    strategies = select(default_strategies(workload.strategy), TINY_BENCHMARK_STRATEGIES)
    return workload, run_benchmark(workload, strategies, matched=False, partial=partial), partial
