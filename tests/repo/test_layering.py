"""The architecture, as import rules: what each folder may import, checked on every module.

policies/ is pure decision logic (no Ray, storage, distributed or file I/O). workers/ runs inside
a training process and knows neither Ray nor the orchestrator. Inside orchestrator/, the storage
format (store/), the Ray-free protocol cores (core/) and the plain torch.distributed runtime
(local/) and the offline tools over a store (offline/: export) import no Ray; only the Ray runtime
(runtime/) does. Nothing but the CLI imports
bench/, and nothing imports the CLI.
"""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
#: Every installed module lives under ``layercheck.``: each folder of the repository is one
#: subpackage (pyproject's ``package-dir``), the API is the ``layercheck/`` folder itself.
FOLDERS = {
    "layercheck": "layercheck",
    "layercheck.policies": "policies",
    "layercheck.workers": "workers",
    "layercheck.orchestrator": "orchestrator",
    "layercheck.bench": "bench",
    "layercheck.examples": "examples",
    "layercheck.dashboards": "dashboards",
}
#: The public API's own modules (the ``layercheck/`` folder), which nothing below it may import;
#: nor may it import the root itself (``import layercheck``, checked apart: a prefix would cover all).
API = tuple(f"layercheck.{p.stem}" for p in (ROOT / "layercheck").glob("*.py") if p.stem != "__init__")
POLICIES_FORBIDDEN = {
    "ray",
    "pyarrow",
    "deepspeed",
    "torch",
    "os",
    "pathlib",
    "shutil",
    "socket",
    "subprocess",
    "tempfile",
    "prometheus_client",
    "safetensors",
    "requests",
}
FORBIDDEN_CALLS = {"open", "print", "input"}
_ORCH = "layercheck.orchestrator"
_BENCH = "layercheck.bench"

#: For each part (longest prefix wins): the imports it must not make (module prefixes).
FORBIDDEN: dict[str, tuple[str, ...]] = {
    "layercheck.policies": tuple(POLICIES_FORBIDDEN) + ("layercheck.workers", _ORCH, _BENCH) + API,
    "layercheck.workers": ("ray", _ORCH, _BENCH) + API,
    f"{_ORCH}.store": (
        "ray",
        f"{_ORCH}.core",
        f"{_ORCH}.runtime",
        f"{_ORCH}.local",
        f"{_ORCH}.offline",
        f"{_ORCH}.cli",
        _BENCH,
    )
    + API,
    f"{_ORCH}.core": ("ray", f"{_ORCH}.runtime", f"{_ORCH}.local", f"{_ORCH}.offline", f"{_ORCH}.cli", _BENCH) + API,
    f"{_ORCH}.local": ("ray", f"{_ORCH}.runtime", f"{_ORCH}.offline", f"{_ORCH}.cli", _BENCH) + API,
    f"{_ORCH}.runtime": (f"{_ORCH}.local", f"{_ORCH}.offline", f"{_ORCH}.cli", _BENCH) + API,
    # offline tools over a store (export): no Ray, nothing of a live run's runtime
    f"{_ORCH}.offline": ("ray", f"{_ORCH}.runtime", f"{_ORCH}.cli", _BENCH) + API,
    f"{_ORCH}.cli": API,
    _ORCH: (f"{_ORCH}.cli", _BENCH) + API,  # modules at the package root
    _BENCH: (f"{_ORCH}.cli",) + API,
    # TRL is a test dependency: the HF callback works without it
    "layercheck": (f"{_ORCH}.cli", _BENCH, "trl"),
    # what a user writes: only the public API and the libraries it runs on
    "layercheck.examples": ("layercheck.workers", _ORCH, _BENCH),
    "layercheck.dashboards": ("layercheck",),
}


def _modules() -> list[Path]:
    return sorted(p for folder in FOLDERS.values() for p in (ROOT / folder).rglob("*.py"))


def _dotted(path: Path) -> str:
    folder, *rest = path.relative_to(ROOT).with_suffix("").parts
    package = next(name for name, f in FOLDERS.items() if f == folder)
    return ".".join([package, *rest]).removesuffix(".__init__")


def _part(module: str) -> str:
    return max((part for part in FORBIDDEN if module == part or module.startswith(part + ".")), key=len)


def _imports(tree: ast.AST) -> list[str]:
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names += [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
    return names


def _matches(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_module_imports_only_what_its_layer_allows(path):
    module = _dotted(path)
    part = _part(module)
    tree = ast.parse(path.read_text(), filename=str(path))
    for name in _imports(tree):
        if part not in ("layercheck", "layercheck.examples"):
            assert name != "layercheck", f"{module} ({part}) imports the public API's root, which {part} must not"
        if _matches(name, part):
            continue  # inside its own part
        for prefix in FORBIDDEN[part]:
            assert not _matches(name, prefix), f"{module} ({part}) imports {name}, which {part} must not"


@pytest.mark.parametrize("path", sorted((ROOT / "policies").glob("*.py")), ids=lambda p: p.name)
def test_policy_module_does_no_io(path):
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            assert node.func.id not in FORBIDDEN_CALLS, f"{path.name} calls {node.func.id}()"


def test_the_rules_see_every_module():
    """A rule-less module would pass silently: every project module falls under one part."""
    modules = [_dotted(p) for p in _modules()]
    assert len(modules) > 60
    assert {_part(m) for m in modules} >= {
        "layercheck.policies",
        "layercheck.workers",
        "layercheck.orchestrator.store",
        "layercheck.orchestrator.core",
        "layercheck.orchestrator.runtime",
        "layercheck.orchestrator.cli",
        "layercheck.bench",
    }


#: Scripts a user runs as they are (``python examples/own_loop.py``): entry points of their own.
USER_SCRIPTS = ("layercheck.examples", "layercheck.dashboards")

#: The only modules that configure logging: the CLI's ``main`` and the helper that process entry
#: points without a ``main`` of ours (Ray actors, the train function, spawned ranks) call.
LOGGING_CONFIGURED_IN = {"layercheck.orchestrator.cli.main", "layercheck.orchestrator.logs"}


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_only_entry_points_configure_logging(path):
    module = _dotted(path)
    if module in LOGGING_CONFIGURED_IN or _part(module) in USER_SCRIPTS:
        return
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in ("basicConfig", "dictConfig", "fileConfig"):
            pytest.fail(
                f"{_dotted(path)} configures logging ({node.attr}); call "
                "layercheck.orchestrator.logs.configure_process_logging() from the process entry point instead"
            )


@pytest.mark.parametrize(
    "module",
    [
        "layercheck.orchestrator.runtime.supervisor_actor",
        "layercheck.orchestrator.runtime.policy_actor",
        "layercheck.orchestrator.core.run_config",
        "layercheck.orchestrator.cli.main",
    ],
)
def test_the_actors_that_only_plan_and_the_cli_start_without_torch(module):
    """The supervisor and the policy actor start at every run (and Ray's processes for them import
    their modules): they read configs and shard headers, never tensors, so they go without torch's
    seconds of import. A module-level ``import torch`` that reaches them again fails here."""
    code = f"import sys, {module}; sys.exit('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, f"importing {module} imports torch\n{result.stderr[-2000:]}"
