"""How much of the package's typing is ``Any``: ``python scripts/any_count.py [--files N]``.

Counts every ``Any`` in an annotation (parameters, returns, annotated assignments; string annotations
too) of each module the wheel installs outside ``layercheck.bench``, and apart those in signatures
that cross modules: public functions, public methods of public classes, and the fields of public
dataclasses, NamedTuples, TypedDicts and Protocols. ``tests/repo/test_typing.py`` holds the second
figure to its ceiling, so an ``Any`` at a seam is a choice someone wrote down.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from package_layout import installed_modules, read_pyproject  # its sibling

ROOT = Path(__file__).resolve().parent.parent
RECORD_BASES = {"NamedTuple", "TypedDict", "Protocol"}


@dataclass(frozen=True)
class AnyCount:
    all: int
    seams: int


def _anys(node: ast.AST | None) -> int:
    if node is None:
        return 0
    count = 0
    for sub in ast.walk(node):
        if isinstance(sub, ast.Name) and sub.id == "Any" or isinstance(sub, ast.Attribute) and sub.attr == "Any":
            count += 1
        elif isinstance(sub, ast.Constant) and isinstance(sub.value, str):
            count += _anys(ast.parse(sub.value, mode="eval")) if _is_annotation_text(sub.value) else 0
    return count


def _is_annotation_text(text: str) -> bool:
    try:
        ast.parse(text, mode="eval")
    except SyntaxError:
        return False
    return "Any" in text


def _signature_anys(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    a = fn.args
    params = [*a.posonlyargs, *a.args, *a.kwonlyargs, *(x for x in (a.vararg, a.kwarg) if x is not None)]
    return sum(_anys(p.annotation) for p in params) + _anys(fn.returns)


def _public(name: str) -> bool:
    return not name.startswith("_") or (name.startswith("__") and name.endswith("__"))


def _is_record(cls: ast.ClassDef) -> bool:
    return any("dataclass" in ast.unparse(d) for d in cls.decorator_list) or any(
        ast.unparse(b).split(".")[-1].split("[")[0] in RECORD_BASES for b in cls.bases
    )


def _seam_anys(body: Iterable[ast.stmt]) -> int:
    count = 0
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _public(node.name):
            count += _signature_anys(node)
        elif isinstance(node, ast.ClassDef) and _public(node.name):
            if _is_record(node):
                count += sum(
                    _anys(f.annotation)
                    for f in node.body
                    if isinstance(f, ast.AnnAssign) and isinstance(f.target, ast.Name) and _public(f.target.id)
                )
            count += _seam_anys(node.body)
    return count


def count_file(path: Path) -> AnyCount:
    tree = ast.parse(path.read_text())
    every = sum(_anys(n.annotation) for n in ast.walk(tree) if isinstance(n, (ast.AnnAssign, ast.arg)))
    every += sum(_anys(n.returns) for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))
    return AnyCount(all=every, seams=_seam_anys(tree.body))


def product_files(root: Path = ROOT) -> list[Path]:
    """The installed modules' files, the benchmark package (``layercheck.bench``) left out."""
    modules = installed_modules(read_pyproject(root), root)
    return sorted(path for name, path in modules if not name.startswith("layercheck.bench"))


def main(argv: list[str]) -> int:
    shown = int(argv[argv.index("--files") + 1]) if "--files" in argv else 0
    counts = {path: count_file(ROOT / path) for path in product_files()}
    print(
        f"Any in annotations: {sum(c.all for c in counts.values())}; "
        f"in signatures that cross modules: {sum(c.seams for c in counts.values())}"
    )
    for path, c in sorted(counts.items(), key=lambda kv: -kv[1].seams)[:shown]:
        print(f"  {c.seams:4d} {c.all:4d}  {path.relative_to(ROOT) if path.is_absolute() else path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
