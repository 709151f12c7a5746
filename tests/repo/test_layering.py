"""The architecture, as import rules: what each folder may import, checked on every module.

policies/ is pure decision logic (no Ray, storage, distributed or file I/O). workers/ runs inside
a training process and knows neither Ray nor the orchestrator. Inside orchestrator/, the storage
format (store/), the Ray-free protocol cores (core/) and the plain torch.distributed runtime
(local/) and the offline tools over a store (offline/: export) import no Ray; only the Ray runtime
(runtime/) does. Nothing but the CLI imports
bench/, and nothing imports the CLI.

The modules checked are those the wheel installs, read from pyproject's ``[tool.setuptools]``
``packages`` and ``package-dir`` (``scripts/package_layout.py``, which ``scripts/typecheck.py`` reads
too), and the research probes of ``bench/probes/``, which are not installed but keep the rules of the
bench they were part of. A folder of Python under a mapped folder that pyproject does not declare
fails: it would be missing from the wheel while the checkout still imports it.
"""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.checkout import package_layout

ROOT = Path(__file__).resolve().parents[2]
LAYOUT = package_layout()
PYPROJECT = LAYOUT.read_pyproject(ROOT)
#: Every installed module (each under ``layercheck.``) and its file in the checkout.
INSTALLED: dict[str, Path] = {name: ROOT / path for name, path in LAYOUT.installed_modules(PYPROJECT, ROOT)}
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


#: The part whose rules the probes (bench/probes/: run from a checkout, not installed) follow.
PROBES_PART = _BENCH


def _part(module: str) -> str:
    return max((part for part in FORBIDDEN if module == part or module.startswith(part + ".")), key=len)


#: Each module checked: its name (a probe's is its path), its file and its part.
MODULES: list[tuple[str, Path, str]] = [(name, path, _part(name)) for name, path in INSTALLED.items()] + [
    (path.as_posix(), ROOT / path, PROBES_PART) for path in LAYOUT.not_installed_modules(ROOT)
]


#: The probes' names as they import one another: top-level modules (their folder is first on
#: ``sys.path`` when one runs), which no installed module may import.
PROBE_NAMES = {path.stem for path in LAYOUT.not_installed_modules(ROOT)}


def _ids(case: tuple[str, Path, str]) -> str:
    return str(case[1].relative_to(ROOT))


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


@pytest.mark.parametrize("case", MODULES, ids=_ids)
def test_module_imports_only_what_its_layer_allows(case):
    module, path, part = case
    tree = ast.parse(path.read_text(), filename=str(path))
    for name in _imports(tree):
        if module in INSTALLED:
            assert name.split(".")[0] not in PROBE_NAMES, f"{module} imports the probe {name}, which the wheel lacks"
        if part not in ("layercheck", "layercheck.examples"):
            assert name != "layercheck", f"{module} ({part}) imports the public API's root, which {part} must not"
        if _matches(name, part):
            continue  # inside its own part
        for prefix in FORBIDDEN[part]:
            assert not _matches(name, prefix), f"{module} ({part}) imports {name}, which {part} must not"


#: The engines' own libraries and LayerCheck's readers of their internals: only the engine adapters
#: (``layercheck.workers.engines``) import them; the policy, store, recovery, supervisor and runtime
#: see an engine through its protocol. Benchmarks (a DeepSpeed checkpoint baseline) and examples
#: (a user's loop) are not the product's core.
ENGINE_INTERNALS = (
    "deepspeed",
    "torch.distributed.fsdp",
    "torch.distributed.tensor",
    "torch.distributed.checkpoint",
    "layercheck.workers.engines.ds_internals",
)
ENGINE_ADAPTERS = "layercheck.workers.engines"


@pytest.mark.parametrize(
    "case", [c for c in MODULES if c[2] not in (_BENCH, PROBES_PART, "layercheck.examples")], ids=_ids
)
def test_only_the_engine_adapters_import_an_engine_s_internals(case):
    module, path, _ = case
    if _matches(module, ENGINE_ADAPTERS):
        return
    for name in _imports(ast.parse(path.read_text(), filename=str(path))):
        for prefix in ENGINE_INTERNALS:
            assert not _matches(name, prefix), f"{module} imports {name}: only {ENGINE_ADAPTERS} may"


def test_the_engine_rule_sees_the_adapters():
    adapters = {m for m, _, _ in MODULES if _matches(m, ENGINE_ADAPTERS)}
    assert {f"{ENGINE_ADAPTERS}.deepspeed", f"{ENGINE_ADAPTERS}.fsdp2", f"{ENGINE_ADAPTERS}.ds_internals"} <= adapters


@pytest.mark.parametrize(
    "path", sorted(p for m, p, part in MODULES if part == "layercheck.policies"), ids=lambda p: p.name
)
def test_policy_module_does_no_io(path):
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            assert node.func.id not in FORBIDDEN_CALLS, f"{path.name} calls {node.func.id}()"


def test_the_rules_see_every_module():
    """A rule-less module would pass silently: every project module falls under one part."""
    assert len(INSTALLED) > 60
    assert {_part(m) for m in INSTALLED} >= {
        "layercheck.policies",
        "layercheck.workers",
        "layercheck.orchestrator.store",
        "layercheck.orchestrator.core",
        "layercheck.orchestrator.runtime",
        "layercheck.orchestrator.cli",
        "layercheck.bench",
    }


def test_every_folder_of_python_is_a_declared_package():
    """A subfolder with modules that pyproject's ``packages`` leaves out installs nothing: the
    checkout imports it, the wheel lacks it. Only the folders ``scripts/package_layout.py`` names as
    not installed (the probes) may be left out, and they must hold Python and not be packages."""
    assert LAYOUT.undeclared_folders(PYPROJECT, ROOT) == []
    declared = set(LAYOUT.package_folders(PYPROJECT).values())
    for folder in LAYOUT.NOT_INSTALLED:
        assert folder not in declared and list((ROOT / folder).glob("*.py")), folder
    assert PROBE_NAMES >= {"fused_issue", "ray_answer", "sender_gil"}


def test_a_subpackage_left_out_of_pyproject_is_found(tmp_path):
    """The check above on a made-up checkout: a mapped folder's undeclared subfolder with a module
    is named; a declared one, one without modules and the not-installed probes are not."""
    for module in ("src/a.py", "src/sub/b.py", "src/forgotten/deep/c.py", "bench/probes/p.py", "bench/__init__.py"):
        (tmp_path / module).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / module).write_text("")
    (tmp_path / "src" / "data").mkdir()
    (tmp_path / "src" / "data" / "corpus.txt").write_text("")
    pyproject = {
        "tool": {
            "setuptools": {
                "packages": ["x", "x.sub", "x.bench"],
                "package-dir": {"x": "src", "x.bench": "bench"},
            }
        }
    }
    assert LAYOUT.package_folders(pyproject) == {"x": Path("src"), "x.sub": Path("src/sub"), "x.bench": Path("bench")}
    assert LAYOUT.undeclared_folders(pyproject, tmp_path) == [Path("src/forgotten/deep")]
    assert [name for name, _ in LAYOUT.installed_modules(pyproject, tmp_path)] == ["x.a", "x.sub.b", "x.bench"]


#: Scripts a user runs as they are (``python examples/own_loop.py``): entry points of their own.
USER_SCRIPTS = ("layercheck.examples", "layercheck.dashboards")

#: The only modules that configure logging: the CLI's ``main`` and the helper that process entry
#: points without a ``main`` of ours (Ray actors, the train function, spawned ranks) call.
LOGGING_CONFIGURED_IN = {"layercheck.orchestrator.cli.main", "layercheck.orchestrator.logs"}


@pytest.mark.parametrize("case", MODULES, ids=_ids)
def test_only_entry_points_configure_logging(case):
    module, path, part = case
    if module in LOGGING_CONFIGURED_IN or part in USER_SCRIPTS:
        return
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in ("basicConfig", "dictConfig", "fileConfig"):
            pytest.fail(
                f"{module} configures logging ({node.attr}); call "
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
