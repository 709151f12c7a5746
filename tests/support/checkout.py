"""What a test loads from the checkout that the installed package does not hold: the layout helper
of ``scripts/`` (pyproject's packages and their folders) and the research probes of
``bench/probes/``. Neither folder is a package; each is loaded as its own scripts see it."""

from __future__ import annotations

import functools
import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]
PROBES = ROOT / "bench" / "probes"


@functools.cache
def package_layout() -> ModuleType:
    """``scripts/package_layout.py``, which ``scripts/typecheck.py`` imports as its sibling."""
    return _script("package_layout")


@functools.cache
def any_count() -> ModuleType:
    """``scripts/any_count.py``, with its sibling ``package_layout`` importable by name."""
    sys.modules.setdefault("package_layout", package_layout())
    return _script("any_count")


def _script(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # a dataclass of the script looks its module up by name
    spec.loader.exec_module(module)
    return module


def probe(name: str) -> ModuleType:
    """The probe ``bench/probes/<name>.py``, imported as the top-level module it is when run as a
    script (``python bench/probes/<name>.py``): with its folder on ``sys.path``, so it imports the
    probes beside it by name, and so do the ranks it spawns (a spawned process starts with its
    parent's ``sys.path``) when they look up its functions."""
    if str(PROBES) not in sys.path:
        sys.path.append(str(PROBES))
    module = importlib.import_module(name)
    assert Path(module.__file__ or "").parent == PROBES, f"{name} resolved to {module.__file__}, not a probe"
    return module
