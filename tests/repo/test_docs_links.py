"""The documentation holds together inside the repository.

* Every link of README.md, CONTRIBUTING.md, docs/*.md and the READMEs beside the code is relative
  and resolves to a file or folder of the repository (not an ignored one such as ``runs/``), and a
  ``#fragment`` into a markdown page names one of its headings. No link leaves the repository: no
  URL, no absolute path, nothing that resolves outside the checkout (``../shared/DESIGN.md``).
* docs/performance.md holds, between its markers, what ``python -m layercheck.bench.render_readme``
  generates from the committed results now.
* docs/README.md, the documentation's index, links every page under docs/.

Figures quoted from bench/results/ are checked against their files in ``test_docs_figures.py``.
"""

import re
import shutil
import subprocess
from pathlib import Path
from urllib.parse import unquote

import pytest

from layercheck.bench import render_readme

REPO = Path(__file__).resolve().parents[2]
PAGES = [
    REPO / "README.md",
    REPO / "CONTRIBUTING.md",
    *sorted((REPO / "docs").glob("*.md")),
    REPO / "bench" / "README.md",
    REPO / "dashboards" / "README.md",
    REPO / "orchestrator" / "store" / "STORE_LAYOUT.md",
]
FENCE = re.compile(r"^(`{3,}|~{3,}).*?^\1[ \t]*$", flags=re.S | re.M)
INLINE_CODE = re.compile(r"(`+)(?!`).*?(?<!`)\1(?!`)")
#: ``[text](target "title")`` and ``![alt](target)``; the text may hold one level of brackets.
INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^()\s<>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_LINK = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$", flags=re.M)
HTML_LINK = re.compile(r"""<(?:a|img)\b[^>]*?\b(?:href|src)\s*=\s*["']([^"']+)["']""", flags=re.I)
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def prose(text: str) -> str:
    """``text`` without its code: fenced blocks and inline code spans hold no links."""
    return INLINE_CODE.sub("", FENCE.sub("", text))


def links(text: str) -> list[str]:
    body = prose(text)
    return INLINE_LINK.findall(body) + REFERENCE_LINK.findall(body) + HTML_LINK.findall(body)


def slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading: its text
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every heading anchor of a markdown page (a repeated heading gets ``-1``, ``-2``, ...)."""
    seen: dict[str, int] = {}
    out = set()
    for match in re.finditer(r"^ {0,3}#{1,6}[ \t]+(.+?)[ \t#]*$", FENCE.sub("", page.read_text()), flags=re.M):
        base = slug(match.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def ignored(path: Path) -> bool:
    """Whether git ignores ``path`` (a run's output, the virtual environment): not in the repository."""
    if shutil.which("git") is None or not (REPO / ".git").exists():
        return False
    done = subprocess.run(["git", "-C", str(REPO), "check-ignore", "-q", str(path)], capture_output=True)
    return done.returncode == 0


def problems(page: Path) -> list[str]:
    found = []
    for target in links(page.read_text()):
        where, _, fragment = target.partition("#")
        if SCHEME.match(target) or target.startswith("//"):
            found.append(f"{target}: a URL, it leaves the repository")
            continue
        if where.startswith("/"):
            found.append(f"{target}: an absolute path; link relative to the page")
            continue
        resolved = (page.parent / unquote(where)).resolve() if where else page
        if not resolved.is_relative_to(REPO):
            found.append(f"{target}: resolves to {resolved}, outside the repository")
        elif not resolved.exists():
            found.append(f"{target}: no such file or folder in the repository")
        elif where and ignored(resolved):
            found.append(f"{target}: git ignores it, so it is not in the repository")
        elif fragment and resolved.suffix == ".md" and fragment not in anchors(resolved):
            found.append(f"{target}: {resolved.relative_to(REPO)} has no heading #{fragment}")
    return found


def test_the_link_rules():
    text = (
        'See [a](docs/x.md#top), ![img](pic.png "t"), [`code` text](../up.md), <a href="h.md">h</a>\n'
        "`[not](a-link.md)`\n```bash\n[not](either.md)\n```\n[ref]: ref.md\n"
    )
    assert links(text) == ["docs/x.md#top", "pic.png", "../up.md", "ref.md", "h.md"]
    assert (
        slug("Hugging Face `Trainer` and TRL: `LayerCheckCallback`")
        == "hugging-face-trainer-and-trl-layercheckcallback"
    )
    assert slug('`[policy]` (name = "staggered", the default)') == "policy-name--staggered-the-default"


def test_the_rules_look_at_every_docs_page():
    assert len(PAGES) >= 10 and all(page.is_file() for page in PAGES)
    assert sum(len(links(page.read_text())) for page in PAGES) > 50


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(REPO)) for p in PAGES])
def test_every_link_resolves_inside_the_repository(page):
    assert not problems(page), f"{page.relative_to(REPO)}:\n" + "\n".join(problems(page))


def test_the_performance_page_holds_what_the_generator_makes_now():
    page = Path(render_readme.DEFAULT_PAGE)
    committed = render_readme.SECTION.part((REPO / page).read_text())
    assert committed is not None, f"{page} lost its markers ({render_readme.BEGIN} ... {render_readme.END})"
    assert committed == render_readme.page_section(page, root=REPO), (
        f"{page} is out of date with bench/results/: regenerate it with "
        "`python -m layercheck.bench.render_readme --write`"
    )


def unindexed(index: Path) -> list[str]:
    """The pages beside ``index`` (docs/*.md) that it does not link."""
    linked = {(index.parent / unquote(t.partition("#")[0])).resolve() for t in links(index.read_text())}
    return [p.name for p in sorted(index.parent.glob("*.md")) if p != index and p.resolve() not in linked]


def test_the_docs_index_links_every_page_under_docs():
    index = REPO / "docs" / "README.md"
    assert len(list(index.parent.glob("*.md"))) > 10, "docs/ is where this test looks"
    assert not unindexed(index), f"docs/README.md does not link {unindexed(index)}: add each to its index"
