"""FSDP2's HSDP (``fully_shard`` over a 2 x 2 replicate x shard mesh) on 4 gloo ranks, attached as a
user's loop attaches it: the replicas split the writes of the shard they share (every element
written once), each rank's drift covers what it writes, and a lost rank's slices come back from its
live twin's capture: the recovery at ``t_fail`` is the state at ``t_fail`` bit for bit and the next
step's loss again."""

from __future__ import annotations

import pytest

from tests.support.dist_harness import run_ranks
from tests.support.hsdp_jobs import LOST, T, hsdp_recovery_job

pytestmark = pytest.mark.slow  # 4 spawned ranks (~15 s on 2 cores)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_ranks(hsdp_recovery_job, 4, str(tmp_path_factory.mktemp("hsdp") / "store"))


def _runs(pieces):
    return sorted((name, offset, length) for layer in pieces.values() for name, offset, length in layer)


def test_the_replicas_split_the_writes_of_their_shard_and_every_element_is_written_once(ranks):
    owned = [run for r in ranks for run in _runs(r["owned"])]
    by_param: dict[str, list[tuple[int, int]]] = {}
    for name, offset, length in owned:
        by_param.setdefault(name, []).append((offset, length))
    for name, runs in by_param.items():
        end = 0
        for offset, length in sorted(runs):
            assert offset == end, (name, runs)  # no gap, no overlap
            end = offset + length
    # twins (same shard coordinate) need the same shard and own halves of it
    mesh = ranks[0]["mesh"]  # [[0, 1], [2, 3]]: rank 1's twin is rank 3
    assert mesh == [0, 1, 2, 3]
    assert ranks[1]["needed"] == ranks[3]["needed"] != ranks[0]["needed"]
    assert set(_runs(ranks[1]["owned"])).isdisjoint(_runs(ranks[3]["owned"]))
    assert all(r["subgroups"] for r in ranks)  # what refuses in place on gloo (test_attach_fsdp2.py)


def test_a_lost_ranks_slices_come_back_from_its_live_twin_exactly(ranks):
    for r in ranks:
        assert r["mismatches"] == [], r["mismatches"][:8]
        assert r["max_staleness"] == 0 and r["adam_steps"] == [T]
        first, again = r["next_loss"]
        assert again == first  # the step after the recovery, as the failure-free run took it
    assert LOST == 1


def test_each_rank_measures_the_drift_of_what_it_writes(ranks):
    for step in ranks[0]["drift"]:
        assert all(r["drift"][step][layer] > 0 for r in ranks for layer in r["drift"][step]), step
