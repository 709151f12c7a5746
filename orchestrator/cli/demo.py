"""``layercheck demo``: the embedded default a newcomer runs first.

Trains the tiny Llama-shaped model of ``examples/demo.toml`` on the bundled corpus with 2 CPU
workers (DeepSpeed ZeRO-3, gloo) on a local Ray — or the cluster in ``RAY_ADDRESS`` — with
LayerCheck checkpointing into ``runs/demo``; one worker is killed part-way, the run recovers at
``t_fail + 1`` and ends with a summary. ``--set`` overrides any field, as for ``train``.
"""

from __future__ import annotations

import argparse

from layercheck.orchestrator.cli import train as train_cmd

DEMO_CONFIG = train_cmd.EXAMPLES / "demo.toml"


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "demo", help="run the embedded demo (tiny model, 2 CPU workers, one failure)", description=__doc__
    )
    train_cmd.add_run_options(p)
    p.set_defaults(func=run, config=DEMO_CONFIG)


def run(args: argparse.Namespace) -> int:
    args.overwrite = not args.resume and args.restart_into is None  # runs/demo belongs to the demo
    return train_cmd.run(args)
