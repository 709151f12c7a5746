"""The store's errors (``layercheck.orchestrator.store.errors``) cross process boundaries intact."""

import pickle

from layercheck.orchestrator.store.errors import CorruptShardError


def test_corrupt_shard_error_survives_pickling():
    error = pickle.loads(pickle.dumps(CorruptShardError(version_id="v", path="p", reason="missing")))
    assert (error.version_id, error.path, error.reason) == ("v", "p", "missing") and "missing" in str(error)
