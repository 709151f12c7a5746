"""``layercheck config``: every field of a run config with its default and meaning, read from
the config classes themselves (each field's docstring), so the reference cannot drift."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import textwrap
import typing

from layercheck.orchestrator.core.run_config import (
    ClusterConfig,
    FaultConfig,
    MetricsConfig,
    PersistenceConfig,
    RunConfig,
)
from layercheck.orchestrator.core.write_budget import WriteBudgetConfig
from layercheck.policies.configs import DriftOptimalConfig, IntervalConfig, LayerCheckConfig, StaggeredConfig
from layercheck.workers.config import EngineConfig, ModelConfig, OptimConfig
from layercheck.workers.data import DataConfig

#: (TOML table, config class), in the order a run file reads.
SECTIONS: tuple[tuple[str, type], ...] = (
    ("", RunConfig),
    ("model", ModelConfig),
    ("data", DataConfig),
    ("optim", OptimConfig),
    ("engine", EngineConfig),
    ('policy (name = "staggered", the default)', StaggeredConfig),
    ('policy (name = "layercheck")', LayerCheckConfig),
    ('policy (name = "drift-optimal")', DriftOptimalConfig),
    ('policy (name = "interval")', IntervalConfig),
    ("cluster", ClusterConfig),
    ("persistence", PersistenceConfig),
    ("persistence.write_budget", WriteBudgetConfig),
    ("fault", FaultConfig),
    ("metrics", MetricsConfig),
)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "config", help="print every run-config field, its default and meaning", description=__doc__
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    print(reference())
    return 0


def reference() -> str:
    blocks = []
    for table, cls in SECTIONS:
        lines = [f"[{table}]" if table else "top level"]
        nested = {f.name for f in dataclasses.fields(cls) if dataclasses.is_dataclass(_type_of(cls, f.name))}
        for name, default, doc in field_docs(cls):
            if name in nested or name == "policy":
                continue
            lines.append(f"  {name} = {default}")
            lines.extend(f"      {line}" for line in textwrap.wrap(doc, 88))
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


def field_docs(cls: type) -> list[tuple[str, str, str]]:
    """``(name, default, docstring)`` of each field, from the class source."""
    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
    defaults = {f.name: f.default for f in dataclasses.fields(cls)}
    out = []
    for node, following in zip(body, [*body[1:], None]):
        if not isinstance(node, ast.AnnAssign) or not isinstance(node.target, ast.Name):
            continue
        name = node.target.id
        if name not in defaults:
            continue  # a ClassVar (e.g. a policy config's ``selective``), not a field
        doc = ""
        if isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant):
            doc = " ".join(str(following.value.value).split())
        default = defaults.get(name, dataclasses.MISSING)
        shown = (
            "(required)"
            if default is dataclasses.MISSING and node.value is None
            else (repr(default) if default is not dataclasses.MISSING else ast.unparse(node.value))
        )
        out.append((name, shown, doc.replace("``", "`")))
    return out


def _type_of(cls: type, name: str) -> object:
    hint = typing.get_type_hints(cls)[name]
    options = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
    return options[0]
