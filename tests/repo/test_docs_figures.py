"""Every figure a page quotes from ``bench/results/`` matches its file (issue 57).

A page quotes a measured figure as a link to the file the figure is read from, with the place in
that file as the link's title, so that a reader can follow it and this test can check it:

    [1.7 s](../bench/results/cpu-in-place/recovery_paths.json "/median/in place + spare/failure_to_step_s")
    [0.24 ms](../bench/results/cpu-answer-future/ray-demo-after-2.txt "policy protocol per step")

* In a JSON file the place is a JSON Pointer (RFC 6901: ``/key/key/0``, ``~1`` for a ``/`` in a key).
  Results files keep base units (seconds, bytes, fractions); the figure's unit says how it is shown:
  ``%`` a fraction times 100, ``ms`` and ``µs`` seconds, ``KiB``/``MiB``/``GiB`` bytes; ``s``, ``x``,
  ``×`` or none, the value as it is.
* In any other file (a run's summary, a printed table) the place is a text that the figure's line
  holds (the first line holding it), and one of that line's numbers, written with at least as many
  decimals as the figure, is the value, in the file's own unit.
* The figure is the value rounded to the decimals the page shows (``1.7 s`` for 1.680, not 1.6).

A figure link into ``bench/results/`` without a title fails: it would be a quote nobody checks. In
the README's results table and in docs/performance.md's hand-written part every decimal figure must
be such a link (the generated part of performance.md is checked by being generated:
``tests/repo/test_docs_links.py``).
"""

import functools
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import pytest

from layercheck.bench import render_readme
from tests.repo.test_docs_links import PAGES, REPO, prose

RESULTS = REPO / "bench" / "results"
#: ``[text](target "title")``, not an image; the title is where in the target the figure is.
LINK = re.compile(r"(?<!!)\[(?P<text>[^\[\]]+)\]\(\s*<?(?P<target>[^()\s<>]+)>?(?:\s+\"(?P<title>[^\"]*)\")?\s*\)")
FIGURE = re.compile(
    r"^(?P<sign>[+\-−]?)(?P<number>\d{1,3}(?:,\d{3})+|\d+)(?:\.(?P<decimals>\d+))?"
    r"(?:\s?(?P<unit>%|ms|µs|s|x|×|KiB|MiB|GiB))?$"
)
#: How a value in base units (seconds, bytes, fractions) is shown in each unit.
SCALE = {"%": 100.0, "ms": 1e3, "µs": 1e6, "KiB": 2.0**-10, "MiB": 2.0**-20, "GiB": 2.0**-30}
NUMBER = re.compile(r"(?<![\w.])-?\d+(?:\.(\d+))?")
#: A figure the strict parts may not state without its link: a decimal, or a number with a ratio's
#: or a percentage's sign; not one inside a name (``Qwen2.5-0.5B``, ``ZeRO-0..3``) nor a bound (``≤ 0.2%``).
LOOSE_FIGURE = re.compile(r"(?<![\w.\-])(?<![≤≥<>] )(?:\d+(?:,\d{3})*\.\d+(?!\.\d)|\d+\s?(?:%|×))")


@dataclass(frozen=True, kw_only=True)
class Quote:
    """One figure link of a page: the figure as shown, the file and the place in it (the link's title)."""

    page: Path
    text: str
    file: Path
    title: str | None

    @classmethod
    def of(cls, page: Path, text: str, target: str, title: str | None) -> "Quote":
        file = (page.parent / unquote(target.partition("#")[0])).resolve()
        return cls(page=page, text=text.strip().strip("*"), file=file, title=title)

    def __repr__(self) -> str:
        return f"{self.page.relative_to(REPO)}: [{self.text}]({self.file.relative_to(REPO)} {self.title!r})"


def quotes(page: Path, text: str | None = None, results: Path = RESULTS) -> list[Quote]:
    """Every link of ``page`` (or of ``text``, read as that page) into ``results`` whose text is a figure."""
    found = []
    for match in LINK.finditer(prose(page.read_text() if text is None else text)):
        quote = Quote.of(page, match["text"], match["target"], match["title"])
        if quote.file.is_relative_to(results) and FIGURE.match(quote.text):
            found.append(quote)
    return found


@functools.cache
def document(path: Path) -> Any:
    """A JSON file's content, read once however many quotes it has (bench.json is half a megabyte)."""
    return json.loads(path.read_text())


def pointer(tree: Any, path: str) -> Any:
    """The value at JSON Pointer ``path`` (RFC 6901) in ``tree``."""
    if not path.startswith("/"):
        raise KeyError(f"{path!r} is not a JSON Pointer (it starts with /)")
    for token in path[1:].split("/"):
        key = token.replace("~1", "/").replace("~0", "~")
        tree = tree[int(key)] if isinstance(tree, list) else tree[key]
    return tree


def rounds_to(value: float, shown: float, decimals: int) -> bool:
    """Whether ``value`` rounded to ``decimals`` places is ``shown`` (a tie may go either way)."""
    return math.isfinite(value) and abs(value - shown) <= 0.5 * 10.0**-decimals * (1 + 1e-9)


def problem(quote: Quote) -> str | None:
    """Why ``quote`` does not match its file, or None when it does."""
    figure = FIGURE.match(quote.text)
    assert figure is not None
    sign = -1.0 if figure["sign"] in ("-", "−") else 1.0
    shown = sign * float(figure["number"].replace(",", "") + "." + (figure["decimals"] or "0"))
    decimals = len(figure["decimals"] or "")
    if not quote.title:
        return "no title: name the place in the file the figure is read from"
    if not quote.file.is_file():
        return "no such file"
    if quote.file.suffix == ".json":
        try:
            value = pointer(document(quote.file), quote.title)
        except (KeyError, IndexError, ValueError, TypeError) as e:
            return f"no value at {quote.title!r}: {e}"
        if isinstance(value, bool) or not isinstance(value, int | float):
            return f"{quote.title!r} holds {value!r}, not a number"
        scaled = value * SCALE.get(figure["unit"] or "", 1.0)
        return None if rounds_to(scaled, shown, decimals) else f"the file holds {scaled:.6g} ({value!r})"
    line = next((line for line in quote.file.read_text().splitlines() if quote.title in line), None)
    if line is None:
        return f"no line holds {quote.title!r}"
    candidates = [m for m in NUMBER.finditer(line) if len(m[1] or "") >= decimals]
    if any(rounds_to(float(m[0]), abs(shown), decimals) for m in candidates):
        return None
    return f"its line holds none that rounds to it: {line.strip()[:200]!r}"


def strict_parts() -> dict[str, str]:
    """The parts of pages where every decimal figure must be a checked quote."""
    readme = (REPO / "README.md").read_text()
    table = readme.split("\n## Results\n", 1)[1].split("\n## ", 1)[0]
    performance = (REPO / render_readme.DEFAULT_PAGE).read_text()
    generated = render_readme.SECTION.part(performance)
    assert generated is not None
    return {
        "README.md's results table": "\n".join(line for line in table.splitlines() if line.startswith("|")),
        "docs/performance.md outside its generated section": performance.replace(generated, ""),
    }


def unquoted_figures(text: str) -> list[str]:
    """The decimal figures of ``text`` that are not the text of a link (whose checks are above)."""
    body = prose(text)
    body = LINK.sub(lambda m: "" if FIGURE.match(m["text"].strip().strip("*")) else m["text"], body)
    return LOOSE_FIGURE.findall(body)


ALL_QUOTES = [quote for page in PAGES for quote in quotes(page)]


def test_the_quote_rules(tmp_path):
    run = tmp_path / "bench" / "results" / "run"
    run.mkdir(parents=True)
    (run / "r.json").write_text(json.dumps({"median": {"a/b": [1.6802, 0.1535]}, "overhead": 0.01604, "n": "x"}))
    (run / "t.txt").write_text("steps  120\npolicy protocol per step   0.24 ms mean, 0.58 ms p90\n")
    page = tmp_path / "docs" / "p.md"
    page.parent.mkdir()
    page.write_text("")

    def check(link: str) -> str:
        """What is wrong with ``link``'s quote, or "ok"."""
        (found,) = quotes(page, link, results=tmp_path / "bench" / "results")
        return problem(found) or "ok"

    assert check('[1.7 s](../bench/results/run/r.json "/median/a~1b/0")') == "ok"
    assert check('**[0.15x](../bench/results/run/r.json "/median/a~1b/1")**') == "ok"
    assert check('[+1.6%](../bench/results/run/r.json "/overhead")') == "ok"
    assert check('[1,680 ms](../bench/results/run/r.json "/median/a~1b/0")') == "ok"
    assert check('[0.24 ms](../bench/results/run/t.txt "policy protocol")') == "ok"
    # a figure that drifted from its file, or names no place, or a place with no number, fails
    assert "1.68" in check('[1.6 s](../bench/results/run/r.json "/median/a~1b/0")')
    assert "1.68" in check('[1.69 s](../bench/results/run/r.json "/median/a~1b/0")')
    assert check('[0.25 ms](../bench/results/run/t.txt "policy protocol")').startswith("its line")
    assert check("[1.7 s](../bench/results/run/r.json)").startswith("no title")
    assert check('[1.7 s](../bench/results/run/r.json "/median/c")').startswith("no value")
    assert check('[1.7 s](../bench/results/run/r.json "/n")').endswith("not a number")
    assert check('[2 s](../bench/results/run/t.txt "no such line")').startswith("no line")
    # a link whose text is not a figure, or that leads elsewhere, is no quote
    assert quotes(page, "[the run](../bench/results/run/r.json) [1.7 s](other.json)", run.parent) == []
    assert unquoted_figures('| [1.7 s](x.json "/a") | 0.15x, 12% and `2.5` | ZeRO-0..3, Qwen2.5-0.5B, ≤ 0.2% |') == [
        "0.15",
        "12%",
    ]


def test_the_pages_quote_figures_this_way():
    assert len(ALL_QUOTES) > 30, "the pages are where this test looks"
    assert {q.page.name for q in ALL_QUOTES} >= {"README.md", "performance.md", "in-place-recovery.md"}


@pytest.mark.parametrize("quote", ALL_QUOTES, ids=repr)
def test_a_quoted_figure_matches_its_file(quote):
    assert problem(quote) is None, f"{quote!r}: {problem(quote)}"


@pytest.mark.parametrize("part", list(strict_parts()))
def test_every_figure_here_is_a_checked_quote(part):
    loose = unquoted_figures(strict_parts()[part])
    assert not loose, (
        f"{part} states figures that are not links to the results file they come from "
        f'([figure](../bench/results/RUN/FILE.json "/json/pointer")): {loose}'
    )
