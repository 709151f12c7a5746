"""The documentation's commands work as written (issue 14): every command in a ```bash block of
README.md, CONTRIBUTING.md and docs/*.md that needs no cluster and no earlier run is run, and must
exit 0.

Selection rule (kept simple so the pages can change freely): a line of a ```bash block is run
when it is ``.venv/bin/layercheck SUB ...`` with ``SUB`` one of :data:`SAFE` — subcommands that only
read the repository (print the config reference, replay the simulator, inspect). Such a line that
names a path the repository does not have (a run's output such as ``runs/demo/drift_trace.json``,
which only a training run makes) is reported as skipped, with the path. A line that redirects or
pipes its output (``> FILE``, ``| cmd``) is left out: it would write into the repository.
``train``, ``export``, ``ray job submit`` and the like need a cluster or a run: the end-to-end
tests cover them. ``.venv/bin/layercheck`` is run as this checkout's ``python -m
layercheck.orchestrator.cli.main`` (the same entry point), in the repository root, with a timeout.
"""

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SAFE = ("config", "simulate", "inspect")
ENTRY = ".venv/bin/layercheck"
TIMEOUT_S = 300
#: Shell operators that make a line more than one command run as written.
SHELL_OPERATORS = {">", ">>", "|", "&&", "||", ";", "<"}


def pages() -> list[Path]:
    """The pages whose commands are run: the README, CONTRIBUTING and every page under docs/."""
    return [REPO / "README.md", REPO / "CONTRIBUTING.md", *sorted((REPO / "docs").glob("*.md"))]


def bash_blocks(text: str) -> list[str]:
    return re.findall(r"^```bash\n(.*?)^```", text, flags=re.S | re.M)


def commands(text: str) -> list[list[str]]:
    """The runnable commands of ``text`` (markdown), as argument lists."""
    found = []
    for block in bash_blocks(text):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if len(words) >= 2 and words[0] == ENTRY and words[1] in SAFE and not SHELL_OPERATORS & set(words):
                found.append(words)
    return found


def missing_paths(words: list[str]) -> list[str]:
    """The arguments that look like paths (a ``/`` in them, not an option) and are not in the repository."""
    return [w for w in words[2:] if "/" in w and not w.startswith("-") and "://" not in w and not (REPO / w).exists()]


def test_the_selection_rule():
    text = (
        "```bash\n.venv/bin/layercheck config   # a comment\n.venv/bin/layercheck train x.toml\n"
        ".venv/bin/layercheck export runs/demo\nray job submit -- layercheck config\n"
        ".venv/bin/layercheck config --markdown > docs/configuration.md\n"
        ".venv/bin/layercheck simulate \\\n  --sweep 1e-3\n```\n```python\n.venv/bin/layercheck config\n```\n"
    )
    assert commands(text) == [[ENTRY, "config"], [ENTRY, "simulate", "--sweep", "1e-3"]]
    assert missing_paths(
        [ENTRY, "simulate", "--trace", "runs/no-such-run/drift_trace.json", "--out", "examples/demo.toml"]
    ) == ["runs/no-such-run/drift_trace.json"]


def page_commands() -> dict[tuple[str, ...], list[str]]:
    """Every distinct runnable command and the pages that show it (a command on two pages runs once)."""
    found: dict[tuple[str, ...], list[str]] = {}
    for page in pages():
        for words in commands(page.read_text()):
            found.setdefault(tuple(words), []).append(str(page.relative_to(REPO)))
    return found


PAGE_COMMANDS = page_commands()


def test_the_pages_have_commands_to_run():
    assert commands((REPO / "README.md").read_text()), "no `.venv/bin/layercheck config|simulate|inspect` in README.md"
    shown_in = {page for where in PAGE_COMMANDS.values() for page in where}
    assert any(page.startswith("docs/") for page in shown_in), "no such command in docs/: the rule looks there too"


@pytest.mark.parametrize(
    "words,where",
    [(list(words), where) for words, where in PAGE_COMMANDS.items()],
    ids=[f"{' '.join(words[1:])} ({', '.join(where)})" for words, where in PAGE_COMMANDS.items()],
)
def test_a_documented_command_runs_as_written(words, where):
    if missing_paths(words):
        pytest.skip(f"names {missing_paths(words)}, which a run makes (not in the repository)")
    env = {**os.environ, "PYTHONPATH": str(REPO), "DS_ACCELERATOR": "cpu"}
    done = subprocess.run(
        [sys.executable, "-m", "layercheck.orchestrator.cli.main", *words[1:]],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert done.returncode == 0, (
        f"{shlex.join(words)} (in {', '.join(where)}) exited {done.returncode}:\n"
        f"{done.stdout[-2000:]}{done.stderr[-2000:]}"
    )
    assert done.stdout.strip(), f"{shlex.join(words)} printed nothing"
