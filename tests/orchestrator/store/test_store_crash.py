"""A writer SIGKILLed at each point of writing and committing a version: the manifest stays
valid, recovery uses the previous version, and GC collects what the crash left."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from layercheck.orchestrator.store.gc import GcConfig, collect_garbage
from layercheck.orchestrator.store.layer_store import LayerStore
from layercheck.orchestrator.store.recovery_source import VersionReader, resolve_plan
from tests.support.store_helpers import PARAMS, layer_state, seed_of, write_layer

REPO = Path(__file__).resolve().parents[3]
LAYERS = {"block.0": 48, "norm": 48}

# (kill point, whether the version is committed when the writer dies)
POINTS = [
    ("opened:layers/", False),  # first shard's temporary file created, nothing in it
    ("partial:layers/", False),  # first shard's header written, tensors not
    ("closed:layers/", False),  # first shard written, not yet renamed into place
    ("renamed:layers/#2", False),  # every shard written, before the commit
    ("opened:manifest/", False),  # commit record being written
    ("closed:manifest/", False),  # commit record written under its temporary name
    ("renamed:manifest/", True),  # committed: the new version is there
]


def _crash_writer(root, point):
    env = {**os.environ, "LAYERCHECK_TEST_KILL_AT": point}
    proc = subprocess.run(
        [sys.executable, "-m", "tests.support.store_writer_proc", str(root), "--layers", "block.0", "--steps", "20"],
        cwd=REPO,
        env=env,
        timeout=120,
    )
    return proc.returncode


@pytest.mark.parametrize("point,committed", POINTS, ids=[p for p, _ in POINTS])
def test_killed_writer_leaves_old_or_new_never_half(tmp_path, point, committed):
    store = LayerStore.open(str(tmp_path))
    for layer in LAYERS:
        write_layer(store, layer, 10, base=True)
    old = store.manifest().by_id()
    assert _crash_writer(tmp_path, point) == -signal.SIGKILL

    manifest = store.manifest()
    assert not manifest.problems
    assert set(old) <= set(manifest.by_id())
    new = [r for r in manifest.records if r.version_id not in old]
    assert len(new) == (1 if committed else 0)
    resolved = resolve_plan(store, LAYERS)
    assert resolved.records["block.0"].step == (20 if committed else 10) and not resolved.skipped
    expected = layer_state(PARAMS, seed=seed_of("block.0", 20 if committed else 10))
    with VersionReader(store, resolved.records["block.0"]) as reader:
        assert reader.read("w", "exp_avg_sq", 0, 30).equal(expected["exp_avg_sq"]["w"])

    referenced = {s.path for r in manifest.records for s in r.shards}
    referenced |= {f"manifest/{version_id}.json" for version_id in manifest.by_id()}
    leftovers = [p for p in tmp_path.rglob("*") if p.is_file() and str(p.relative_to(tmp_path)) not in referenced]
    assert bool(leftovers) != committed
    young = collect_garbage(store, GcConfig(grace_s=3600))
    assert young.orphans == ()  # too young to be sure the writer is gone
    report = collect_garbage(store, GcConfig(grace_s=0))
    assert len(report.orphans) == len(leftovers)
    assert store.manifest().by_id().keys() == manifest.by_id().keys()
    assert not [p for p in tmp_path.rglob("*.tmp")]
    for record in store.versions():
        assert store.check_version(record) == []
