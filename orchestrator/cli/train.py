"""``layercheck train CONFIG``: run a fine-tuning job with LayerCheck checkpointing on Ray Train,
on the cluster in ``RAY_ADDRESS`` (or the job's, under ``ray job submit``), else on a local Ray."""

from __future__ import annotations

import argparse
import contextlib
import importlib.resources
import json
import logging
import shlex
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from layercheck.orchestrator.store.errors import (
    StoreBusyError,
    StoreUnavailableError,
    StoreWriteError,
    UnsafeStoreError,
)
from layercheck.orchestrator.store.lease import LEASE_LOST
from layercheck.orchestrator.store.uri import redact_uri
from layercheck.policies.config_loader import ConfigError

if TYPE_CHECKING:
    from layercheck.orchestrator.core.run_config import RunConfig

logger = logging.getLogger(__name__)

#: The example configs and bundled data, shipped as package data (``layercheck.examples``).
EXAMPLES = Path(str(importlib.resources.files("layercheck.examples")))


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("train", help="run a training job with LayerCheck checkpointing", description=__doc__)
    p.add_argument("config", type=Path, help="run config (.toml, .yaml or .json); see examples/")
    add_run_options(p)
    p.set_defaults(func=run)


def add_run_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config field, e.g. --set steps=50 --set policy.k0=2e-3 (VALUE is JSON, else a string)",
    )
    p.add_argument("--overwrite", action="store_true", help="delete checkpoints an earlier run left in the storage")
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue the run in the storage from its newest recoverable step (any number of workers)",
    )
    p.add_argument(
        "--restart-into",
        metavar="STORAGE",
        default=None,
        help="start over from the initial weights in a new store STORAGE (when --resume is refused "
        "because a layer has no usable version; the old store is kept as it is)",
    )
    p.add_argument(
        "--take-over",
        action="store_true",
        help="take the store even if another run's lease on it is live (only when that run is dead)",
    )
    p.add_argument("--json", action="store_true", help="print the closing summary as JSON")


def run(args: argparse.Namespace) -> int:
    from layercheck.orchestrator.core.run_config import load_run_config

    overrides = dict(_override(item) for item in args.set)
    resume = args.resume
    if args.restart_into is not None:
        if args.overwrite:
            print(
                "layercheck train: --restart-into writes a new store; it does not go with --overwrite", file=sys.stderr
            )
            return 2
        overrides["storage"], resume = args.restart_into, False
    try:
        config = load_run_config(args.config, overrides)
    except ConfigError as error:
        print(f"layercheck train: {error}", file=sys.stderr)
        return 2
    return train_and_report(
        config,
        overwrite=args.overwrite,
        resume=resume,
        as_json=args.json,
        take_over=args.take_over,
        resume_command=resume_command(args),
    )


def resume_command(args: argparse.Namespace) -> str:
    """The command that continues this run from its store (what a stopped run prints), without
    the storage URI's credentials: printed, it reaches logs (``ray job logs``); the resume takes
    them from the environment (``AWS_ACCESS_KEY_ID``, ...) as every run should."""
    words = ["layercheck", "train", str(args.config)]
    for item in args.set:
        if not (args.restart_into is not None and item.startswith("storage=")):
            words += ["--set", _redacted_storage(item)]
    if args.restart_into is not None:
        words += ["--set", _redacted_storage(f"storage={args.restart_into}")]
    return shlex.join(words + ["--resume"])


def _redacted_storage(item: str) -> str:
    key, _, value = item.partition("=")
    return f"storage={redact_uri(value)}" if key == "storage" else item


#: Exit status of a run stopped by Ctrl-C (the shell's convention for SIGINT: 128 + 2).
EXIT_INTERRUPTED = 130


def train_and_report(
    config: RunConfig,
    *,
    overwrite: bool,
    as_json: bool,
    resume: bool = False,
    take_over: bool = False,
    resume_command: str = "",
) -> int:
    from layercheck.orchestrator.core.run_start import ResumeError
    from layercheck.orchestrator.runtime.driver import train
    from layercheck.orchestrator.runtime.progress_lines import ProgressLines
    from layercheck.orchestrator.runtime.run_summary import format_summary, summarize

    progress = ProgressLines(config.log_every)
    # Ctrl-C stops the run cleanly (fit_watch.fit_watched); a shell that starts us in the background
    # leaves SIGINT ignored, where `kill -INT` must still stop the run the same way
    signal.signal(signal.SIGINT, signal.default_int_handler)

    def show(status: dict[str, Any]) -> None:
        for line in progress(status):
            print(line, flush=True)

    # with --json, stdout carries the summary alone: whatever else the run prints (Ray's own
    # messages about lost workers, libraries' notices) goes to stderr
    quiet = contextlib.redirect_stdout(sys.stderr) if as_json else contextlib.nullcontext()
    try:
        with quiet:
            result = train(
                config, overwrite=overwrite, resume=resume, take_over=take_over, on_progress=None if as_json else show
            )
    except (
        FileExistsError,
        FileNotFoundError,
        ConfigError,
        UnsafeStoreError,
        StoreBusyError,
        ResumeError,
        StoreWriteError,
        StoreUnavailableError,
    ) as error:
        # each is a setup the driver refused before it wrote anything (ConfigError: data and model;
        # StoreUnavailableError: the storage refused the credentials or did not answer)
        print(f"layercheck train: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # before training started: nothing to save
        print("layercheck train: interrupted (Ctrl-C) before training started", file=sys.stderr)
        return EXIT_INTERRUPTED
    summary = summarize(result)
    print(json.dumps(summary, indent=2, default=str) if as_json else "\n" + format_summary(summary), flush=True)
    stopped = result.interrupted or bool(result.status.get("stop_reason"))
    if str(result.status.get("stop_reason") or "").startswith(LEASE_LOST):
        print(
            f"\nstopped after step {summary.get('steps')}: another run took this store over, and it is that "
            f"run's now. Once that run has ended, this one can continue from the store:\n  {resume_command}",
            file=sys.stderr,
            flush=True,
        )
    elif result.supervisor_lost and resume_command:  # (the summary's state row says why, in the same words)
        print(
            f"\n{result.supervisor_lost}. To continue this run from its newest recoverable step:\n  {resume_command}",
            file=sys.stderr,
            flush=True,
        )
    elif stopped and resume_command:
        print(
            f"\nstopped after step {summary.get('steps')}; to continue this run:\n  {resume_command}",
            file=sys.stderr,
            flush=True,
        )
    if result.interrupted:
        return EXIT_INTERRUPTED
    return 0 if result.error is None else 1


def _override(item: str) -> tuple[str, Any]:
    key, sep, value = item.partition("=")
    if not sep:
        raise SystemExit(f"layercheck train: --set wants KEY=VALUE, got {item!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value
