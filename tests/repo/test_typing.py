"""``Any`` at the package's seams stays where it is put (issue 57): the signatures that cross modules
(public functions and methods, public dataclass, NamedTuple, TypedDict and Protocol fields) hold at
most ``SEAM_ANY_CEILING`` of them, counted by ``scripts/any_count.py``. Lower the ceiling when a
change removes some; raise it only with a reason in the commit."""

from tests.support.checkout import any_count

#: 370 on 2026-12-07 before the typed seams of issue 57; 115 after them.
SEAM_ANY_CEILING = 115


def test_any_at_the_seams_stays_under_its_ceiling():
    counter = any_count()
    seams = sum(counter.count_file(path).seams for path in counter.product_files())
    assert seams <= SEAM_ANY_CEILING, (
        f"{seams} Any in cross-module signatures, over the ceiling {SEAM_ANY_CEILING}: "
        "type the new seam (python scripts/any_count.py --files 20 lists where they are)"
    )


def test_the_count_sees_each_kind_of_seam(tmp_path):
    source = tmp_path / "m.py"
    source.write_text(
        "from dataclasses import dataclass\n"
        "from typing import Any\n"
        "def public(a: Any, *, b: 'dict[str, Any]') -> Any: ...\n"
        "def _private(a: Any) -> Any: ...\n"
        "@dataclass\n"
        "class Record:\n"
        "    field: Any\n"
        "    _own: Any = None\n"
        "    def method(self, x: list[Any]) -> None: ...\n"
        "class _Hidden:\n"
        "    def method(self, x: Any) -> None: ...\n"
        "local: Any = None\n"
    )
    count = any_count().count_file(source)
    assert (count.seams, count.all) == (5, 10)
