"""The commit path (``layercheck.orchestrator.core.persistence.commit_path``), stepped one event at a time (no
Ray): a version is committed once every rank's shard is written; a failed commit is retried with
backoff, then counted lost with its reason, and not retried once a newer version committed; a
lost group's incomplete versions are committed as partial versions up to t_fail, or abandoned."""

import dataclasses
import logging

from layercheck.orchestrator.core.persistence.commit_path import (
    CommitFailed,
    CommitPath,
    CommitSucceeded,
    CommitVersion,
    ShardWritten,
)
from layercheck.orchestrator.core.recovery.config import SupervisionConfig
from layercheck.orchestrator.core.recovery.events import AbandonIncomplete
from tests.support.store_helpers import faulty_store, receipt, write_layer, written_receipts

LAYERS = ("embed", "block.0", "norm")
CONFIG = SupervisionConfig(drain_deadline_s=5.0, commit_tries=3, commit_backoff_s=0.5)


def commit(store, action):
    try:
        return CommitSucceeded(record=store.commit(list(action.receipts)))
    except Exception as error:
        return CommitFailed(action=action, error=f"{type(error).__name__}: {error}")


def test_a_commit_that_fails_is_retried_with_backoff_and_then_succeeds(tmp_path):
    store, fs = faulty_store(str(tmp_path / "s"))
    commits = CommitPath(layers=LAYERS, config=CONFIG)
    first, second = written_receipts(store, "embed", 4)
    assert commits.handle(ShardWritten(receipt=first)) == []
    (action,) = commits.handle(ShardWritten(receipt=second))
    assert action == CommitVersion(receipts=(first, second))
    fs.read_only = True  # the store refuses the record
    (retry,) = commits.handle(commit(store, action))
    assert (retry.tries, retry.delay_s) == (2, 0.5) and commits.commit_retries == 1
    fs.read_only = False
    assert commits.handle(commit(store, retry)) == []
    assert commits.stats["embed"].versions == 1 and commits.stats["embed"].last_step == 4
    assert commits.lost_versions == 0 and [v.step for v in store.versions()] == [4]


def test_a_commit_that_fails_for_good_is_counted_lost_with_its_reason(caplog):
    commits = CommitPath(layers=LAYERS, config=CONFIG)
    commits.handle(ShardWritten(receipt=receipt("norm", 7, 0)))
    (action,) = commits.handle(ShardWritten(receipt=receipt("norm", 7, 1)))
    caplog.set_level(logging.ERROR, logger="layercheck.orchestrator.core.persistence.commit_path")
    delays = []
    while action is not None:
        retries = commits.handle(CommitFailed(action=action, error="StoreWriteError: disk full"))
        action = retries[0] if retries else None
        delays += [action.delay_s] if action else []
    assert delays == [0.5, 1.0] and commits.commit_retries == 2
    assert commits.lost_versions == 1 and "norm step 7 failed 3 time(s), last: StoreWriteError" in commits.lost[0]
    assert "lost 1 version(s)" in caplog.text
    assert commits.stats["norm"].versions == 0


def test_a_failed_commit_is_not_retried_once_a_newer_version_of_the_layer_committed(store):
    commits = CommitPath(layers=LAYERS, config=CONFIG)
    commits.handle(ShardWritten(receipt=receipt("embed", 5, 0)))
    (old,) = commits.handle(ShardWritten(receipt=receipt("embed", 5, 1)))
    newer, _ = write_layer(store, "embed", 6)
    commits.handle(CommitSucceeded(record=newer))
    assert commits.handle(CommitFailed(action=old, error="timeout")) == []
    assert commits.lost_versions == 0 and commits.tracker.abandoned == 1


def test_a_lost_groups_partial_versions_are_abandoned_not_lost():
    commits = CommitPath(layers=LAYERS, config=CONFIG)
    commits.handle(ShardWritten(receipt=receipt("embed", 5, 0)))
    commits.handle(AbandonIncomplete(reason="the group was lost"))
    assert commits.tracker.abandoned == 1 and commits.lost_versions == 0 and commits.tracker.incomplete == 0


def test_a_lost_groups_incomplete_versions_up_to_t_fail_are_committed_as_partial_versions():
    commits = CommitPath(layers=["embed", "norm"])
    assert commits.handle(ShardWritten(receipt=receipt("embed", 6, 0))) == []  # rank 1 died before writing
    assert commits.handle(ShardWritten(receipt=receipt("norm", 7, 0))) == []  # past t_fail = 6
    captured = dataclasses.replace(receipt("norm", 6, 0), origin="capture")
    assert commits.handle(ShardWritten(receipt=captured)) == []  # never merged with a policy snapshot
    actions = commits.handle(AbandonIncomplete(reason="group lost", keep_upto=6))
    assert sorted((a.receipts[0].layer, a.receipts[0].origin, a.partial) for a in actions) == [
        ("embed", "policy", True),
        ("norm", "capture", True),
    ]
    assert commits.tracker.incomplete == 0 and commits.tracker.abandoned == 3  # as whole versions, all three
