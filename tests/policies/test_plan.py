import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from layercheck.policies.plan import NoUsableVersionError, VersionRef, newest_recoverable_step, plan_recovery

NUMEL = {"embed": 100, "block.0": 50, "block.1": 50}


def v(layer, step, base=False, vid=None):
    return VersionRef(step=step, layer=layer, version_id=vid or f"{layer}@{step}", base=base)


BASE = [v(name, 10, base=True) for name in NUMEL]


def test_picks_newest_at_or_before_t_fail_and_falls_back_to_base():
    versions = BASE + [v("block.0", 20), v("block.0", 30), v("block.0", 45), v("embed", 25)]
    plan = plan_recovery(NUMEL, versions, t_fail=40)
    assert [c.version.version_id for c in plan.choices] == ["embed@25", "block.0@30", "block.1@10"]
    assert plan.version_of("block.1").base
    assert [c.staleness for c in plan.choices] == [15, 10, 30]
    assert plan.max_staleness == 30
    assert plan.weighted_staleness == pytest.approx((100 * 15 + 50 * 10 + 50 * 30) / 200)


def test_skipped_versions_fall_back_to_the_previous_one():
    versions = BASE + [v("block.0", 20), v("block.0", 30)]
    plan = plan_recovery(NUMEL, versions, t_fail=40, skip={"block.0@30"})
    assert plan.version_of("block.0").step == 20
    plan = plan_recovery(NUMEL, versions, t_fail=40, skip={"block.0@30", "block.0@20"})
    assert plan.version_of("block.0").base


def test_refuses_when_a_layer_has_nothing_usable():
    versions = [v("embed", 10, base=True), v("block.0", 10, base=True)]
    with pytest.raises(NoUsableVersionError, match=r"block\.1 \(tried: no version"):
        plan_recovery(NUMEL, versions, t_fail=40)
    with pytest.raises(NoUsableVersionError, match=r"embed \(tried: embed@10\)"):
        plan_recovery(NUMEL, BASE, t_fail=40, skip={"embed@10"})
    with pytest.raises(NoUsableVersionError):
        plan_recovery(NUMEL, BASE, t_fail=5)  # before the base


def test_newest_recoverable_step():
    assert newest_recoverable_step(NUMEL, BASE + [v("block.0", 30)]) == 30
    assert newest_recoverable_step(NUMEL, [v("embed", 10)]) is None


@settings(max_examples=80, deadline=None)
@given(
    steps=st.dictionaries(st.sampled_from(list(NUMEL)), st.lists(st.integers(11, 200), max_size=8)),
    t_fail=st.integers(10, 220),
)
def test_plan_choice_is_the_newest_eligible(steps, t_fail):
    versions = BASE + [v(layer, s) for layer, ss in steps.items() for s in set(ss)]
    plan = plan_recovery(NUMEL, versions, t_fail=t_fail)
    for choice in plan.choices:
        eligible = [x.step for x in versions if x.layer == choice.layer and x.step <= t_fail]
        assert choice.version.step == max(eligible)
        assert choice.staleness == t_fail - choice.version.step >= 0
    assert plan.max_staleness <= t_fail - 10


def test_a_partial_version_is_never_a_layers_whole_choice():
    whole = VersionRef(step=4, layer="a", version_id="a4")
    partial = VersionRef(step=7, layer="a", version_id="a7p", partial=True)
    plan = plan_recovery({"a": 10}, [whole, partial], t_fail=8)
    assert plan.version_of("a") == whole and plan.max_staleness == 4
    with pytest.raises(NoUsableVersionError):
        plan_recovery({"a": 10}, [partial], t_fail=8)
    assert newest_recoverable_step(["a"], [partial]) is None  # no whole version: no recovery point


def test_the_newest_recoverable_step_counts_the_survivors_partial_versions():
    """A failure's captures, committed at its t_fail, whose recovery never finished (the driver
    lost during it): --resume plans at their step and overlays them, as the recovery would have."""
    refs = [
        VersionRef(step=100, layer="a", version_id="a100"),
        VersionRef(step=104, layer="b", version_id="b104"),
        VersionRef(step=110, layer="a", version_id="a110c", partial=True, origin="capture"),
        VersionRef(step=120, layer="c", version_id="c120p", partial=True),  # a layer not in the run
    ]
    t = newest_recoverable_step(["a", "b"], refs)
    assert t == 110
    plan = plan_recovery({"a": 10, "b": 10}, refs, t_fail=t)
    assert plan.version_of("a").version_id == "a100"
    assert [o.version_id for o in next(c for c in plan.choices if c.layer == "a").overlays] == ["a110c"]
    assert not plan.passed_over


def test_a_plan_without_versions_names_a_few_layers_not_all():
    """A 32-layer model with no version at all: one short line a person reads, not 32 entries."""
    layers = {"embed": 4, **{f"block.{i}": 4 for i in range(30)}, "norm": 2}
    with pytest.raises(NoUsableVersionError) as error:
        plan_recovery(layers, [VersionRef(step=5, layer="embed", version_id="embed@5")], 3)
    message = str(error.value)
    # (embed's only version is after step 3: it has none either)
    assert "32 layers: embed, block.0, block.1 … norm (tried: no version at or before the step)" in message
    assert len(message) < 200, message
