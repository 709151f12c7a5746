"""The ``layercheck`` command line: one subcommand per module, each with ``register(subparsers)``
that adds its parser and sets ``func`` (taking the parsed args, returning an exit code)."""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys

#: Modules that contribute subcommands, in the order they are listed in ``--help``.
COMMAND_MODULES: tuple[str, ...] = (
    "layercheck.orchestrator.cli.demo",
    "layercheck.orchestrator.cli.train",
    "layercheck.orchestrator.cli.config",
    "layercheck.orchestrator.cli.simulate",
    "layercheck.orchestrator.cli.store",
    "layercheck.orchestrator.cli.bench",
    "layercheck.orchestrator.cli.export",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="layercheck",
        description="Adaptive layer-wise checkpointing for DeepSpeed fine-tuning on Ray Train.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log at DEBUG level")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in COMMAND_MODULES:
        importlib.import_module(module).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        return int(args.func(args) or 0)
    except BrokenPipeError:  # `layercheck inspect RUN | head`: the reader has gone, nothing is wrong
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # so the interpreter's own flush at exit fails quietly
        return 0


if __name__ == "__main__":
    sys.exit(main())
