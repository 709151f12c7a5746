"""``layercheck inspect | verify | gc RUN``: look at, check and prune a run's layer store.

RUN is a store URI or path (``/data/run1``, ``file:///…``, ``s3://bucket/run1``, ``gs://…``).
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
from collections.abc import Callable
from typing import Any

import pyarrow.fs as pafs

from layercheck.orchestrator.store.errors import StoreUnavailableError
from layercheck.orchestrator.store.gc import GcConfig, collect_garbage
from layercheck.orchestrator.store.layer_store import LayerStore
from layercheck.orchestrator.store.manifest import Manifest
from layercheck.orchestrator.store.uri import redact_uri
from layercheck.orchestrator.table import format_table, human_bytes
from layercheck.policies.plan import newest_recoverable_step
from layercheck.policies.retention import RetentionConfig

logger = logging.getLogger(__name__)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "inspect", help="print a run's manifest: per layer, newest version and staleness", description=__doc__
    )
    p.add_argument("run", help="store URI or path")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=answered(run_inspect))

    p = subparsers.add_parser(
        "verify", help="re-read every committed shard and check sizes and checksums", description=__doc__
    )
    p.add_argument("run", help="store URI or path")
    p.set_defaults(func=answered(run_verify))

    p = subparsers.add_parser(
        "gc",
        help="delete versions no recovery point needs, and old orphans",
        description=__doc__,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("run", help="store URI or path")
    p.add_argument("--window", type=int, default=0, help="keep every step in [newest - WINDOW, newest] recoverable")
    p.add_argument(
        "--grace",
        type=float,
        default=3600.0,
        help="seconds an uncommitted file is left alone (a write may be in progress)",
    )
    p.add_argument("--dry-run", action="store_true", help="print what would be freed, delete nothing")
    p.set_defaults(func=answered(run_gc))


def answered(command: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """``command``, with a storage that stops answering (or refuses the credentials) midway said in
    one line and exit status 2: nothing about the run follows from it (``StoreUnavailableError``)."""

    @functools.wraps(command)
    def run(args: argparse.Namespace) -> int:
        try:
            return command(args)
        except StoreUnavailableError as error:
            print(f"error: {error}")
            return 2

    return run


def model_order(layer: str) -> tuple[int, int, str]:
    """embed, block.0 … block.N (numerically), norm, lm_head, then anything else by name."""
    if layer.startswith("block.") and layer[6:].isdigit():
        return (1, int(layer[6:]), "")
    return ({"embed": 0, "norm": 2, "lm_head": 3}.get(layer, 4), 0, layer)


def summarize(manifest: Manifest) -> dict[str, Any]:
    """Per layer: newest whole version, its staleness, the partial versions (survivors' captures)
    newer than it that recovery would overlay, bytes, number of versions; and totals."""
    layers = sorted(manifest.layers(), key=model_order)
    newest_step = newest_recoverable_step(layers, manifest.refs())
    rows: list[dict[str, Any]] = []
    for layer in layers:
        versions = [r for r in manifest.records if r.layer == layer]
        whole = [r for r in versions if not r.partial] or versions
        newest = max(whole, key=lambda r: (r.step, not r.base))
        partial = sorted((r for r in versions if r.partial and r.step > newest.step), key=lambda r: -r.step)
        rows.append(
            {
                "layer": layer,
                "newest_step": newest.step,
                "newest_version": newest.version_id,
                "base": newest.base,
                "staleness": None if newest_step is None else newest_step - newest.step,
                "newest_bytes": newest.nbytes,
                "partial": [
                    {
                        "version_id": r.version_id,
                        "step": r.step,
                        "origin": r.origin,
                        "ranks": [e.rank for e in r.shards],
                    }
                    for r in partial
                ],
                "versions": len(versions),
                "bytes": sum(r.nbytes for r in versions),
            }
        )
    base_steps = sorted({r.step for r in manifest.records if r.base})
    return {
        "newest_recoverable_step": newest_step,
        "base_steps": base_steps,
        "layers": rows,
        "totals": {
            "layers": len(rows),
            "versions": len(manifest.records),
            "bytes": sum(r.nbytes for r in manifest.records),
            "max_staleness": max((r["staleness"] or 0 for r in rows), default=0),
        },
        "problems": list(manifest.problems),
    }


def _open(run: str) -> LayerStore | None:
    """The store at ``run``, or None (with a message) when there is none: a mistyped path must
    not read as an empty, healthy run."""
    try:
        store = LayerStore.open(run, fsync=False)
        found = store.fs.info("").type == pafs.FileType.Directory or bool(store.fs.list_files("manifest"))
    except StoreUnavailableError as error:  # it names the store already, and the cause
        print(f"error: {error}")
        return None
    except (OSError, ValueError) as error:  # (a URI's user:password@ must not reach the screen)
        print(f"error: cannot open store {redact_uri(run)}: {error}")
        return None
    if not found:
        print(f"error: no store at {store.uri}")
        return None
    return store


def _partial_cell(partial: list[dict[str, Any]]) -> str:
    """The newest partial version newer than the whole one, e.g. ``190 capture (ranks 0)``, and how many more."""
    if not partial:
        return ""
    p = partial[0]
    more = f" +{len(partial) - 1}" if len(partial) > 1 else ""
    return f"{p['step']} {p['origin']} (ranks {','.join(map(str, p['ranks']))}){more}"


def run_inspect(args: argparse.Namespace) -> int:
    store = _open(args.run)
    if store is None:
        return 2
    summary = summarize(store.manifest())
    if args.json:
        print(json.dumps({"run": store.uri, **summary}, indent=1))
        return 0
    print(
        f"run {store.uri}: newest recoverable step {summary['newest_recoverable_step']}, "
        f"base at {summary['base_steps'] or 'none'}"
    )
    rows = [
        [
            r["layer"],
            r["newest_step"],
            "yes" if r["base"] else "",
            "-" if r["staleness"] is None else r["staleness"],
            human_bytes(r["newest_bytes"]),
            _partial_cell(r["partial"]),
            r["versions"],
            human_bytes(r["bytes"]),
        ]
        for r in summary["layers"]
    ]
    totals = summary["totals"]
    rows.append(
        ["total/max", "", "", totals["max_staleness"], "", "", totals["versions"], human_bytes(totals["bytes"])]
    )
    headers = ["layer", "newest", "base", "staleness", "newest size", "newer partial", "versions", "all versions"]
    print(format_table(headers, rows))
    for problem in summary["problems"]:
        print(f"warning: {problem}")
    return 0


def run_verify(args: argparse.Namespace) -> int:
    store = _open(args.run)
    if store is None:
        return 2
    manifest = store.manifest()
    problems = list(manifest.problems)
    files = 0
    for record in manifest.records:
        found = store.check_version(record, deep=True)
        files += len(record.shards)
        problems += [f"version {record.version_id} (layer {record.layer} step {record.step}): {p}" for p in found]
    for record, why in manifest.fenced:  # by the rule every reader applies: not damage, not counted
        print(f"FENCED version {record.version_id} (layer {record.layer} step {record.step}): {why}; ignored")
    fenced = (
        f"; {len(manifest.fenced)} fenced-out version(s) ignored, layercheck gc deletes them" if manifest.fenced else ""
    )
    if problems:
        for problem in problems:
            print(f"BAD {problem}")
        print(f"{len(problems)} problem(s) in {store.uri}{fenced}")
        return 1
    total = sum(r.nbytes for r in manifest.records)
    print(f"OK {store.uri}: {len(manifest.records)} versions, {files} files, {human_bytes(total)} verified{fenced}")
    return 0


def run_gc(args: argparse.Namespace) -> int:
    try:
        config = GcConfig(retention=RetentionConfig(window=args.window), grace_s=args.grace, dry_run=args.dry_run)
    except ValueError as error:
        print(f"error: {error}")
        return 2
    store = _open(args.run)
    if store is None:
        return 2
    report = collect_garbage(store, config)
    verb = "would delete" if report.dry_run else "deleted"
    for version_id in report.deleted_versions:
        print(
            f"{verb} version {version_id}{' (fenced out: a superseded run committed it)' if version_id in report.fenced else ''}"
        )
    for rel in report.orphans:
        print(f"{verb} orphan {rel}")
    print(
        f"{'would free' if report.dry_run else 'freed'} {human_bytes(report.freed_bytes)}: "
        f"{len(report.deleted_versions)} version(s), {len(report.orphans)} orphan file(s); "
        f"{report.kept} version(s) kept (newest recoverable step {report.newest_step}, window {args.window})"
    )
    for version_id, why in report.damaged.items():
        print(f"warning: damaged version {version_id} kept, and the versions a recovery falls back to instead: {why}")
    if report.damaged:
        print(f"warning: {len(report.damaged)} damaged version(s); run layercheck verify {redact_uri(args.run)}")
    if report.kept_files:
        print(
            f"warning: kept {len(report.kept_files)} uncommitted file(s) that a damaged commit record may name; "
            f"run layercheck verify {redact_uri(args.run)}, then move or repair the record it names"
        )
    if report.foreign:
        for rel in report.foreign:
            print(f"kept foreign {rel}")
        print(
            f"warning: kept {len(report.foreign)} file(s) LayerCheck did not write in its layers/ and manifest/ "
            "(not its naming: never deleted); a run directory should hold only LayerCheck's files, move them away"
        )
    for message in report.errors:
        print(f"error: {message}")
    return 1 if report.errors else 0
