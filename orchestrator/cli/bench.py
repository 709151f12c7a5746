"""``layercheck bench`` and ``layercheck ettr``: the checkpointing benchmark (every strategy, one
run, same workload and failures) and the cluster-scale ETTR model fed by its JSON.

    layercheck bench                              # tiny model, 2 CPU ranks, a few minutes
    layercheck bench --out bench/results/cpu-default
    layercheck bench --preset qwen2.5-0.5b --out bench/results/gpu-0.5b   # on a GPU machine
    layercheck ettr bench/results/cpu-default/bench.json --storage-gbps 1
"""

from __future__ import annotations

import argparse

from layercheck.bench import cli


def register(subparsers: argparse._SubParsersAction) -> None:
    bench = subparsers.add_parser(
        "bench",
        help="benchmark every checkpointing strategy in one run",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    cli.add_bench_arguments(bench)
    bench.set_defaults(func=cli.run_bench)
    ettr = subparsers.add_parser(
        "ettr",
        help="ETTR per strategy at cluster scale from a bench report",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    cli.add_ettr_arguments(ettr)
    ettr.set_defaults(func=cli.run_ettr)
