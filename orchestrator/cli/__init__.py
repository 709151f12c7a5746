"""The ``layercheck`` command line: one module per subcommand; :func:`main` is the entry point."""

from layercheck.orchestrator.cli.main import build_parser, main

__all__ = ["build_parser", "main"]
