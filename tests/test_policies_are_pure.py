"""policies/ holds decision logic only: no Ray, storage, distributed or file I/O."""

import ast
from pathlib import Path

import pytest

POLICIES = Path(__file__).resolve().parent.parent / "policies"
FORBIDDEN_MODULES = {"ray", "pyarrow", "deepspeed", "torch", "os", "pathlib", "shutil", "socket",
                     "subprocess", "tempfile", "prometheus_client", "safetensors", "requests"}
FORBIDDEN_CALLS = {"open", "print", "input"}


@pytest.mark.parametrize("path", sorted(POLICIES.glob("*.py")), ids=lambda p: p.name)
def test_policy_module_is_pure(path):
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module or ""]
        else:
            names = []
        for name in names:
            assert name.split(".")[0] not in FORBIDDEN_MODULES, f"{path.name} imports {name}"
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            assert node.func.id not in FORBIDDEN_CALLS, f"{path.name} calls {node.func.id}()"
