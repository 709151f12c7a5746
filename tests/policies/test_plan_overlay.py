"""The recovery plan per (layer, element range): partial versions overlaid on a layer's whole
choice, newest first; which source supplies which elements; element-weighted staleness."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from layercheck.policies.overlay import claim, element_staleness, merge_spans
from layercheck.policies.plan import VersionRef, plan_recovery, with_sources

NUMEL = {"a": 100, "b": 40}


def v(layer, step, *, partial=False, origin="policy", base=False, vid=None):
    return VersionRef(
        step=step, layer=layer, version_id=vid or f"{layer}@{step}", base=base, partial=partial, origin=origin
    )


WHOLE = [v("a", 10, base=True), v("b", 10, base=True), v("b", 16)]


def test_newer_partial_versions_up_to_t_fail_overlay_the_whole_choice_newest_first():
    partials = [
        v("a", 12, partial=True, vid="a12p"),
        v("a", 15, partial=True, origin="capture", vid="a15c"),
        v("a", 18, partial=True, origin="capture", vid="a18c"),
        v("a", 9, partial=True, vid="a9p"),
        v("b", 14, partial=True, vid="b14p"),
    ]
    plan = plan_recovery(NUMEL, WHOLE + partials, t_fail=15)
    a, b = plan.choices
    assert a.version.version_id == "a@10" and [o.version_id for o in a.overlays] == ["a15c", "a12p"]
    assert b.version.version_id == "b@10"  # b@16 is after t_fail
    assert [o.version_id for o in b.overlays] == ["b14p"]
    assert "would apply the updates of steps 16..18 twice" in plan.passed_over["a18c"]
    assert "not newer than the whole version a@10" in plan.passed_over["a9p"]
    assert set(plan.passed_over) == {"a18c", "a9p"}


def test_a_partial_version_older_than_the_whole_choice_is_passed_over():
    plan = plan_recovery(NUMEL, [*WHOLE, v("b", 14, partial=True, vid="b14p")], t_fail=20)
    assert plan.version_of("b").step == 16 and plan.choices[1].overlays == ()
    assert "not newer" in plan.passed_over["b14p"]


def test_skipped_partial_versions_are_not_overlaid():
    partial = v("a", 12, partial=True, vid="a12p")
    plan = plan_recovery(NUMEL, [*WHOLE, partial], t_fail=15, skip={"a12p": "corrupt"})
    assert plan.choices[0].overlays == () and "a12p" not in plan.passed_over


def test_sources_count_elements_after_newer_overlays_took_theirs():
    partials = [v("a", 12, partial=True, vid="a12p"), v("a", 15, partial=True, origin="capture", vid="a15c")]
    plan = plan_recovery(NUMEL, WHOLE + partials, t_fail=15)
    coverage = {"a15c": {"w": [(0, 30)]}, "a12p": {"w": [(20, 50)], "g": [(0, 10)]}}
    plan = with_sources(plan, NUMEL, coverage, {"a15c": (0,), "a12p": (1, 2), "a@10": (0, 1, 2)})
    a, b = plan.choices
    assert [(s.version_id, s.origin, s.step, s.ranks, s.elements) for s in a.sources] == [
        ("a15c", "capture", 15, (0,), 30),
        ("a12p", "policy", 12, (1, 2), 30),
        ("a@10", "policy", 10, (0, 1, 2), 40),
    ]
    assert [(s.version_id, s.elements) for s in b.sources] == [("b@10", 40)]
    assert a.staleness == 5 and b.staleness == 5
    assert plan.max_staleness == 5
    assert plan.weighted_staleness == pytest.approx((30 * 0 + 30 * 3 + 40 * 5 + 40 * 5) / 140)


def test_an_overlay_shadowed_by_newer_ones_is_dropped_and_passed_over():
    """A survivor's capture at t_fail holds every element its earlier partial versions hold:
    recovery reads the capture's files, not theirs."""
    partials = [v("a", 12, partial=True, vid="a12p"), v("a", 15, partial=True, origin="capture", vid="a15c")]
    plan = plan_recovery(NUMEL, WHOLE + partials, t_fail=15)
    plan = with_sources(plan, NUMEL, {"a15c": {"w": [(0, 30)]}, "a12p": {"w": [(10, 20)]}})
    a = plan.choices[0]
    assert [o.version_id for o in a.overlays] == ["a15c"]
    assert [(s.version_id, s.elements) for s in a.sources] == [("a15c", 30), ("a@10", 70)]
    assert "newer partial versions hold every element" in plan.passed_over["a12p"]


def test_a_layer_wholly_covered_by_a_capture_is_as_fresh_as_the_capture():
    plan = plan_recovery({"a": 10}, [v("a", 4, base=True), v("a", 9, partial=True, origin="capture")], t_fail=9)
    plan = with_sources(plan, {"a": 10}, {"a@9": {"w": [(0, 6)], "b": [(0, 4)]}})
    assert [s.elements for s in plan.choices[0].sources] == [10, 0]
    assert plan.max_staleness == 0 and plan.weighted_staleness == 0


def test_overlays_covering_more_than_the_layer_are_refused():
    plan = plan_recovery({"a": 10}, [v("a", 4, base=True), v("a", 9, partial=True)], t_fail=9)
    with pytest.raises(ValueError, match="cover 12 elements, the layer has 10"):
        with_sources(plan, {"a": 10}, {"a@9": {"w": [(0, 12)]}})


spans = st.lists(st.tuples(st.integers(0, 40), st.integers(0, 40)).map(sorted).map(tuple), max_size=4)
coverages = st.lists(st.dictionaries(st.sampled_from(["w", "b"]), spans, max_size=2), max_size=4)


@settings(max_examples=200, deadline=None)
@given(coverages)
def test_each_element_is_claimed_by_the_newest_overlay_holding_it(covs):
    claims = claim(covs)
    for param in ("w", "b"):
        owner = {}
        for c in claims.get(param, ()):
            assert c.start < c.end
            for e in range(c.start, c.end):
                assert e not in owner, "claims overlap"
                owner[e] = c.source
        for e in range(40):
            holders = [i for i, cov in enumerate(covs) if any(s <= e < t for s, t in cov.get(param, ()))]
            assert owner.get(e) == (holders[0] if holders else None)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 30), st.integers(0, 30)).map(sorted).map(tuple), max_size=6))
def test_merged_spans_cover_the_same_elements(raw):
    merged = merge_spans(raw)
    assert all(a[1] < b[0] for a, b in zip(merged, merged[1:]))
    assert {e for s, t in merged for e in range(s, t)} == {e for s, t in raw for e in range(s, t)}


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 20), st.integers(0, 10)), min_size=1, max_size=4), st.integers(20, 30))
def test_element_staleness_is_the_element_weighted_mean_and_the_stalest_supplied_element(shares, t_fail):
    from layercheck.policies.overlay import LayerSource

    sources = tuple(
        LayerSource(origin="policy", version_id=f"v{i}", step=step, ranks=(), elements=n)
        for i, (step, n) in enumerate(shares)
    )
    total = sum(n for _, n in shares)
    per_layer, weighted = element_staleness({"a": total}, {"a": sources}, t_fail)
    supplied = [t_fail - step for step, n in shares if n > 0]
    assert per_layer["a"] == (max(supplied) if supplied else max(t_fail - s for s, _ in shares))
    if total:
        assert weighted == pytest.approx(sum(n * (t_fail - s) for s, n in shares) / total)
