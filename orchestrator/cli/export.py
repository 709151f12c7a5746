"""``layercheck export RUN --format deepspeed|dcp|hf --out DIR``: write a run's composite as a
checkpoint other tools load.

The composite at ``--step T`` (default: the newest recoverable step) takes, for every layer, its
newest usable version at or before ``T``. ``deepspeed``: a DeepSpeed checkpoint directory (tag
``stepT``) for ``--world-size`` ranks (default: the run's ``cluster.num_workers``) at the run's
ZeRO stage and precision; ``engine.load_checkpoint(DIR)`` resumes from it and DeepSpeed's
``zero_to_fp32.py`` converts it. ``dcp``: a PyTorch Distributed Checkpoint of the model under
``fully_shard`` and its optimizer (``get_state_dict``'s ``{"model": ..., "optim": ...}``), saved by
``--world-size`` ranks; ``dcp.load`` reads it into an FSDP2 model at any world size. ``hf``: a Hugging Face model folder (config + safetensors) for
``AutoModelForCausalLM.from_pretrained``. The run's config is read from ``run.json`` in RUN, or
from ``--config FILE``.
"""

from __future__ import annotations

import argparse
import logging

from layercheck.orchestrator.offline.export_run import ExportError
from layercheck.orchestrator.offline.exporter import FORMATS, RANKED_FORMATS, export
from layercheck.orchestrator.store.errors import StoreUnavailableError
from layercheck.orchestrator.store.uri import redact_uri
from layercheck.policies.config_loader import ConfigError

logger = logging.getLogger(__name__)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "export",
        help="write a run's composite as a DeepSpeed, DCP (FSDP2) or Hugging Face checkpoint",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("run", help="store URI or path of the run")
    p.add_argument("--format", required=True, choices=FORMATS, dest="fmt", help="checkpoint format")
    p.add_argument("--out", required=True, help="directory to write (a new or empty one for hf)")
    p.add_argument("--step", type=int, default=None, help="the step T to export (default: newest recoverable)")
    p.add_argument(
        "--world-size",
        type=int,
        default=None,
        help="deepspeed and dcp: ranks that save the checkpoint (default: the run's cluster.num_workers; "
        "a DCP checkpoint loads at any world size)",
    )
    p.add_argument("--config", default=None, help="the run's config file, when RUN has no run.json")
    p.add_argument(
        "--merge",
        action="store_true",
        help="a run that trained a peft adapter: write the base model with the adapter merged in "
        "(default: the adapter alone, in peft's format)",
    )
    p.set_defaults(func=run_export)


def run_export(args: argparse.Namespace) -> int:
    if args.world_size is not None and args.fmt not in RANKED_FORMATS:
        print(f"error: --world-size applies to --format {' and '.join(RANKED_FORMATS)} only")
        return 2
    try:
        written = export(
            args.run,
            fmt=args.fmt,
            out=args.out,
            step=args.step,
            world_size=args.world_size,
            config_path=args.config,
            merge=args.merge,
        )
    except (ExportError, ConfigError, StoreUnavailableError) as error:
        print(f"error: {error}")
        return 2
    print(f"exported {redact_uri(args.run)} ({args.fmt}) to {written}")
    return 0
