"""The reliability page (docs/reliability.md, once README's Reliability section) names the test
behind each row: every ``tests/….py`` it names exists, and every ``tests/….py::name`` is a test
defined in that file (the ``[param]`` part aside), so the matrix cannot point at a test that was
renamed or never written. The same holds for every test any other page names (README.md,
CONTRIBUTING.md, docs/*.md, bench/README.md, dashboards/README.md)."""

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
RELIABILITY = REPO / "docs" / "reliability.md"
REFERENCE = re.compile(r"`(tests/[\w/]+\.py)(?:::(\w+))?(?:\[[^\]`]*\])?`")
PAGES = [
    REPO / "README.md",
    REPO / "CONTRIBUTING.md",
    *sorted((REPO / "docs").glob("*.md")),
    REPO / "bench" / "README.md",
    REPO / "dashboards" / "README.md",
]


def defined_tests(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {node.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)}


def problems(text: str) -> list[str]:
    """Each ``tests/…`` reference of ``text`` that names a missing file or a test its file lacks."""
    found = []
    for file, name in REFERENCE.findall(text):
        path = REPO / file
        if not path.is_file():
            found.append(f"{file}: no such file")
        elif name and name not in defined_tests(path):
            found.append(f"{file}::{name}: no such test in the file")
    return found


def test_every_test_the_reliability_page_names_exists():
    text = RELIABILITY.read_text()
    assert len(REFERENCE.findall(text)) > 20  # the page and its tables are where this test looks
    assert not problems(text), "\n".join(problems(text))


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(REPO)) for p in PAGES])
def test_every_test_a_page_names_exists(page):
    assert not problems(page.read_text()), "\n".join(
        f"{page.relative_to(REPO)}: {p}" for p in problems(page.read_text())
    )
