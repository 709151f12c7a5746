"""README's Reliability section names the test behind each row: every ``tests/….py`` it names
exists, and every ``tests/….py::name`` is a test defined in that file (the ``[param]`` part
aside), so the matrix cannot point at a test that was renamed or never written."""

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
REFERENCE = re.compile(r"`(tests/[\w/]+\.py)(?:::(\w+))?(?:\[[^\]`]*\])?`")


def reliability_section() -> str:
    text = (REPO / "README.md").read_text()
    start = text.index("\n## Reliability")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else len(text)]


def defined_tests(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {node.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)}


def test_every_test_the_reliability_section_names_exists():
    references = REFERENCE.findall(reliability_section())
    assert len(references) > 20  # the section and its tables are where this test looks
    problems = []
    for file, name in references:
        path = REPO / file
        if not path.is_file():
            problems.append(f"{file}: no such file")
        elif name and name not in defined_tests(path):
            problems.append(f"{file}::{name}: no such test in the file")
    assert not problems, "\n".join(problems)
