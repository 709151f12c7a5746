"""The commit tracker (``layercheck.orchestrator.core.persistence.commit_tracker``): a version is whole once every
rank's receipt is in; older incomplete versions are abandoned once a newer one commits."""

from layercheck.orchestrator.core.persistence.commit_tracker import CommitTracker
from tests.support.store_helpers import receipt


def test_commit_tracker_waits_for_every_rank_and_abandons_superseded_versions():
    tracker = CommitTracker()
    assert tracker.add(receipt("embed", 5, 0)) is None
    assert tracker.add(receipt("embed", 7, 1)) is None  # rank 0's step-7 shard is still queued
    whole = tracker.add(receipt("embed", 7, 0))
    assert [r.rank for r in whole] == [0, 1]
    tracker.committed("embed", 7)
    assert tracker.incomplete == 0 and tracker.abandoned == 1  # step 5 never completes
    assert tracker.add(receipt("embed", 5, 1)) is None  # late, older than what is committed
    tracker.add(receipt("norm", 9, 0))
    assert tracker.forget_incomplete() == 1
