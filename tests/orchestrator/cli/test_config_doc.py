"""The configuration reference cannot drift from the code: every field of every config class has
a docstring, ``layercheck config`` prints them, and ``docs/configuration.md`` is committed exactly
as ``layercheck config --markdown`` generates it from those docstrings now."""

import dataclasses
from pathlib import Path

import pytest

from layercheck.orchestrator.cli.config import PAGE, SECTIONS, field_docs, markdown
from layercheck.orchestrator.cli.main import main

REPO = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("table,cls", SECTIONS, ids=[cls.__name__ for _, cls in SECTIONS])
def test_every_run_config_field_is_documented(table, cls):
    documented = {name: doc for name, _, doc in field_docs(cls)}
    assert set(documented) == {f.name for f in dataclasses.fields(cls)}
    assert all(documented.values()), [name for name, doc in documented.items() if not doc]


def test_config_command_prints_the_reference(capsys):
    assert main(["config"]) == 0
    out = capsys.readouterr().out
    assert "[engine]\n  backend = 'deepspeed'" in out and "smax = 1000" in out and "kill_at_step = 0" in out


def test_the_committed_reference_page_is_what_the_generator_makes_now():
    assert (REPO / PAGE).read_text() == markdown() + "\n", (
        f"{PAGE} is out of date with the config classes: regenerate it with "
        f"`.venv/bin/layercheck config --markdown > {PAGE}`"
    )


def test_config_markdown_prints_the_page(capsys):
    assert main(["config", "--markdown"]) == 0
    page = capsys.readouterr().out
    assert page == markdown() + "\n"
    assert "## `[engine]`\n" in page and "| `zero_stage` | `0` |" in page
    assert '## `[policy]` (name = "staggered", the default)' in page and "| `smax` | `1000` |" in page
