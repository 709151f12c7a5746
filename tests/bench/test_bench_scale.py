"""The scale harness (``layercheck bench --scale``, ``bench/scale/``): the pieces on their own, and
the whole harness at N = 8 on a local two-node Ray cluster, as CI runs it."""

import json

import pytest

from layercheck.bench.scale import countfs
from layercheck.bench.scale.harness import ScaleConfig
from layercheck.bench.scale.plan_many import plan_over_versions
from layercheck.bench.scale.report import run_ranks, table
from layercheck.bench.scale.shapes import LLAMA31_70B, QWEN25_7B, scaled_numel
from layercheck.bench.scale.synthetic import SyntheticRank
from layercheck.orchestrator.store.layer_store import LayerStore
from layercheck.workers.host_buffers import HostBufferPool
from layercheck.workers.layer_state import snapshot_layers

#: The fields ``scale.json``'s rows must have (issue 59), each a figure the harness measured.
ROW_FIELDS = (
    "n_ranks",
    "actor_cpu_ms_per_step",
    "calls_per_rank_per_step",
    "decision_latency_ms",
    "commit_latency_ms",
    "plan_s",
    "versions",
    "store_requests_per_step",
    "writer_rss_bytes",
)


def test_the_layer_tables_are_the_published_models():
    assert len(QWEN25_7B.layer_numel()) == 31 and round(QWEN25_7B.numel / 1e9, 2) == 7.62
    assert len(LLAMA31_70B.layer_numel()) == 83 and round(LLAMA31_70B.numel / 1e9, 2) == 70.55
    scaled = scaled_numel(QWEN25_7B, 1000)
    assert list(scaled) == list(QWEN25_7B.layer_numel()) and scaled["norm"] == 3


def test_a_synthetic_rank_owns_its_share_and_snapshots_as_an_engine_would():
    numel = scaled_numel(QWEN25_7B, 10_000)
    ranks = [SyntheticRank(numel, rank=r, world_size=3, drift_every=10) for r in range(3)]
    assert sum(r.layout["block.0"].owned_numel for r in ranks) == numel["block.0"]
    drift = ranks[1].step(11, 1e-5)
    assert drift.measured and set(drift.l1) == set(numel)
    assert not ranks[1].step(12, 1e-5).measured
    (shard,) = snapshot_layers(ranks[1].layout, ["block.3"], HostBufferPool())
    assert (shard.step, shard.optimizer_step, shard.rank, shard.world_size) == (12, 12, 1, 3)


@pytest.fixture
def counted():
    """Stores opened in this process counted, until the test ends."""
    countfs.install()
    yield
    countfs.uninstall()


def test_the_counting_filesystem_counts_the_stores_requests(tmp_path, counted):
    before = countfs.snapshot()
    store = LayerStore.open(str(tmp_path / "store"), fsync=False)
    store.fs.write_bytes("manifest/x.json", b"{}")
    store.fs.list_files("manifest")
    store.fs.read_bytes("manifest/x.json")
    counted = countfs._minus(countfs.snapshot(), before)
    assert (counted["put"], counted["list"], counted["get"]) == (1, 1, 1)


def test_the_plan_over_a_history_reads_no_record_from_the_supervisors_own_manifest(tmp_path, counted):
    plan = plan_over_versions(124, shape="qwen2.5-7b", scale=10_000, root=tmp_path)
    assert plan["versions"] == 124 and plan["kept_t_fail"] == plan["t_fail"] == 4
    assert plan["requests"]["get"] == 124  # the manifest read: one GET per record
    assert plan["kept_requests"]["list"] == 0 and plan["kept_requests"]["get"] == plan["plan_requests"]["get"]


def test_the_harness_at_8_ranks_measures_every_figure_survives_a_writers_death_and_recovers_in_place(tmp_path):
    """The whole harness, as ``layercheck bench --scale --ranks 8`` runs it, shortened, and with a
    fault at scale (issue 59): mid-window the first node's writer actor is killed with what its
    four ranks handed it still queued. Its ranks find it dead at their next hand-over, the
    supervisor replaces it once (not once per rank) before the window ends, the ranks hand the
    new one what they hold, and nothing is lost; the failure and the in-place recovery follow."""
    config = ScaleConfig(ranks=8, nodes=2, steps=14, warm=2, writer_dies_after=6, fail_after=12, step_s=0.25)
    report = run_ranks([8], config, work_dir=tmp_path / "work", out=tmp_path / "out")
    assert report["stopped"] is None
    (row,) = json.loads((tmp_path / "out" / "scale.json").read_text())["rows"]
    assert all(field in row for field in ROW_FIELDS)
    calls = row["calls_per_rank_per_step"]
    # one report a step, whatever N; a report leaves on the rank's sending thread, so one sent
    # late for the step before the window may be counted in it (at most one per rank)
    assert 1.0 <= calls["policy.report"] <= 1.0 + 1 / (config.fail_after - config.warm)
    assert row["decision_latency_ms"]["n"] == 8  # step 11 is measured: every rank timed its answer
    assert set(row["actor_cpu_ms_per_step"]) == {"policy", "supervisor", "writers"}
    assert row["versions"] >= 31 and row["plan_s"] is not None
    assert row["recovery_s"]["death_to_resume_s"] > 0 and row["store_requests_recovery"]["get"] > 0
    assert sum(row["store_requests_per_step"].values()) > 0 and row["writer_rss_bytes"] > 0
    assert not [note for note in row["notes"] if note.startswith("resumed at")]
    assert "Ray Train's controller is not in the harness" in table(report)
    faults = row["faults"]
    assert faults["queued_then"] > 0 and faults["lost_versions"] == 0
    assert faults["replaced_by_window_end"] == faults["writers_replaced"] == 1
    assert f"{faults['writer_killed']} killed with {faults['queued_then']} snapshot(s) queued" in table(report)
