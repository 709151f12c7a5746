"""``layercheck demo``: the embedded default that a newcomer runs first.

Today it replays a synthetic fine-tuning drift trace through the LayerCheck policy and sweeps
``K0`` against full checkpoints at matched freshness (what ``layercheck simulate --sweep``
prints). The training demo on a local Ray cluster replaces it once the orchestrator lands; the
command stays the same.
"""

from __future__ import annotations

import argparse

from orchestrator import simulate_cmd


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("demo", help="run the embedded demo", description=__doc__)
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    sim_args = simulate_cmd.register_defaults()
    sim_args.sweep = "2.5e-4,5e-4,1e-3,2e-3,4e-3"
    sim_args.json = args.json
    sim_args.verbose = args.verbose
    return simulate_cmd.run(sim_args)
