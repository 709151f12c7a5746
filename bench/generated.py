"""A generated section of a docs page: the text between two marker comments, which a bench
script writes (``--write``) and a test compares with what the script makes now
(``render_readme.py``'s performance tables, ``scale/sizing.py``'s sizing tables)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class GeneratedSection:
    begin: str
    """The opening marker (an HTML comment naming the command that writes the section)."""
    end: str

    def part(self, content: str) -> str | None:
        """The section as ``content`` (a page's text) holds it between the markers; None without them."""
        if self.begin not in content or self.end not in content:
            return None
        return content.split(self.begin, 1)[1].split(self.end, 1)[0].strip("\n")

    def write_into(self, page: Path, text: str) -> None:
        """Replace the marked section of ``page`` with ``text`` (or append it at the end)."""
        content = page.read_text()
        block = f"{self.begin}\n{text}\n{self.end}"
        if self.begin in content and self.end in content:
            head, rest = content.split(self.begin, 1)
            content = head + block + rest.split(self.end, 1)[1]
        else:
            content = content.rstrip("\n") + "\n\n" + block + "\n"
        page.write_text(content)
