"""docs/cluster.md's sizing tables are what ``python -m layercheck.bench.scale.sizing`` makes from the
committed results now (issue 59): a changed measurement, assumption or model shows here until the
page is regenerated."""

from layercheck.bench.scale import sizing
from tests.repo.test_docs_links import REPO


def test_the_cluster_page_holds_the_sizing_tables_the_generator_makes_now():
    committed = sizing.SECTION.part((REPO / sizing.PAGE).read_text())
    assert committed is not None, f"{sizing.PAGE} lost its markers ({sizing.BEGIN} ... {sizing.END})"
    scale = REPO / sizing.SCALE_JSON
    assert scale.is_file(), f"{sizing.SCALE_JSON} is missing: commit `layercheck bench --scale --out {scale.parent}`"
    assert committed == sizing.section(sizing.measured(REPO)), (
        f"{sizing.PAGE} is out of date with bench/results/: regenerate it with "
        "`python -m layercheck.bench.scale.sizing --write`"
    )
