"""The architecture, as import rules: what each folder may import, checked on every module.

policies/ is pure decision logic (no Ray, storage, distributed or file I/O). workers/ runs inside
a training process and knows neither Ray nor the orchestrator. Inside orchestrator/, the storage
format (store/), the Ray-free protocol cores (core/) and the plain torch.distributed runtime
(local/) import no Ray; only the Ray runtime (runtime/) does. Nothing but the CLI imports
bench/, and nothing imports the CLI.
"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("policies", "workers", "orchestrator", "bench", "layercheck")
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

#: For each part (longest prefix wins): the imports it must not make (module prefixes).
FORBIDDEN: dict[str, tuple[str, ...]] = {
    "policies": tuple(POLICIES_FORBIDDEN) + ("workers", "orchestrator", "bench", "layercheck"),
    "workers": ("ray", "orchestrator", "bench", "layercheck"),
    "orchestrator.store": (
        "ray",
        "orchestrator.core",
        "orchestrator.runtime",
        "orchestrator.local",
        "orchestrator.cli",
        "bench",
        "layercheck",
    ),
    "orchestrator.core": (
        "ray",
        "orchestrator.runtime",
        "orchestrator.local",
        "orchestrator.cli",
        "bench",
        "layercheck",
    ),
    "orchestrator.local": ("ray", "orchestrator.runtime", "orchestrator.cli", "bench", "layercheck"),
    "orchestrator.runtime": ("orchestrator.local", "orchestrator.cli", "bench", "layercheck"),
    "orchestrator.cli": ("layercheck",),
    "orchestrator": ("orchestrator.cli", "bench", "layercheck"),  # modules at the package root
    "bench": ("orchestrator.cli", "layercheck"),
    "layercheck": ("orchestrator.cli", "bench", "trl"),  # TRL is a test dependency: the HF callback works without it
}


def _modules() -> list[Path]:
    return sorted(p for package in PACKAGES for p in (ROOT / package).rglob("*.py"))


def _dotted(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


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
        "policies",
        "workers",
        "orchestrator.store",
        "orchestrator.core",
        "orchestrator.runtime",
        "orchestrator.cli",
        "bench",
    }


#: The only modules that configure logging: the CLI's ``main`` and the helper that process entry
#: points without a ``main`` of ours (Ray actors, the train function, spawned ranks) call.
LOGGING_CONFIGURED_IN = {"orchestrator.cli.main", "orchestrator.logs"}


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_only_entry_points_configure_logging(path):
    if _dotted(path) in LOGGING_CONFIGURED_IN:
        return
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in ("basicConfig", "dictConfig", "fileConfig"):
            pytest.fail(
                f"{_dotted(path)} configures logging ({node.attr}); call "
                "orchestrator.logs.configure_process_logging() from the process entry point instead"
            )
