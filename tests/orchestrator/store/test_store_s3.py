"""The store on an S3-compatible server (moto on loopback, the real pyarrow S3 client): versions
written, committed and recovered; the owner lease; an outage mid-run that fails writes and
commits with the path and the cause, loses nothing committed, and ends with writes working again
(the "S3 outage" row of the reliability page's fault-injection matrix)."""

import json
import math
import threading

import pytest

from layercheck.orchestrator.core.run_config import load_run_config
from layercheck.orchestrator.core.run_start import StartOptions, claim_store, open_run_store
from layercheck.orchestrator.store.errors import StoreBusyError, StoreWriteError, UnsafeStoreError
from layercheck.orchestrator.store.fs import StoreFS
from layercheck.orchestrator.store.layer_store import RUN_CONFIG_FILE, LayerStore
from layercheck.orchestrator.store.lease import StoreLease, read_lease
from layercheck.orchestrator.store.recovery_source import VersionReader, resolve_plan
from layercheck.orchestrator.store.run_dir import check_run_location, clear_run
from layercheck.orchestrator.store.uri import open_uri, redact_uri
from layercheck.policies.config_loader import ConfigError
from tests.support.s3_server import FAST_FAIL
from tests.support.store_helpers import PARAMS, cut_shards, even_cuts, foreign_lease, layer_state, seed_of, write_layer

LAYERS = {"embed": 48, "block.0": 48, "norm": 48}
#: A hang guard, not a performance bound: a write that has not returned by then never will.
HANG_S = 120


def returns(call, *args, **kwargs):
    """``call(*args, **kwargs)`` in a thread; fails the test if it has not returned in HANG_S."""
    outcome = {}

    def run():
        try:
            outcome["value"] = call(*args, **kwargs)
        except BaseException as error:  # handed to the test below
            outcome["error"] = error

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(HANG_S)
    assert outcome, f"{call.__name__} still running after {HANG_S}s"
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def assert_loads(store, record, layer):
    with VersionReader(store, record) as reader:
        expected = layer_state(PARAMS, seed=seed_of(layer, record.step))
        assert reader.read("w", "exp_avg", 0, 30).equal(expected["exp_avg"]["w"])


def test_a_layer_store_on_s3_writes_commits_and_recovers(s3):
    uri = s3.uri("runs/a")
    store = LayerStore.open(uri)
    assert not store.fs.atomic_rename  # a PUT is atomic, a rename is not
    check_run_location(store.fs)
    for step, layers in ((10, LAYERS), (20, ["block.0"]), (30, ["norm", "block.0"])):
        for layer in layers:
            write_layer(store, layer, step)
    resolved = resolve_plan(store, LAYERS)
    assert resolved.plan.t_fail == 30 and not resolved.skipped
    assert {layer: r.step for layer, r in resolved.records.items()} == {"embed": 10, "block.0": 30, "norm": 30}
    assert_loads(store, resolved.records["block.0"], "block.0")
    # a reader in another process opens the same URI and sees the same versions
    assert {v.version_id for v in LayerStore.open(uri).versions()} == {v.version_id for v in store.versions()}
    # locations in messages keep the endpoint (they name the store the user configured)
    assert store.uri == uri and store.fs.uri("x") == uri.replace("runs/a?", "runs/a/x?")


def test_the_lease_on_s3_refuses_a_second_owner_and_takes_over_a_stale_one(s3):
    fs = StoreFS.open(s3.uri("runs/leased"))
    lease = StoreLease.acquire(fs, run="mine", settle_s=0.1)
    assert read_lease(fs).owner == lease.info.owner
    lease.release()
    foreign_lease(fs)
    with pytest.raises(StoreBusyError) as error:
        StoreLease.acquire(fs, run="mine", settle_s=0.1)
    assert "run 'other'" in str(error.value) and s3.endpoint in str(error.value)
    foreign_lease(fs, expires_in=-1)
    taken = StoreLease.acquire(fs, run="mine", settle_s=0.1)
    assert read_lease(fs).owner == taken.info.owner and read_lease(fs).run == "mine"
    taken.release()
    assert read_lease(fs) is None


def test_claiming_and_overwriting_a_run_on_s3(s3):
    uri = s3.uri("runs/claimed")
    lease = claim_store(uri, run="first", options=StartOptions())
    write_layer(LayerStore.open(uri), "norm", 5)
    lease.release()
    with pytest.raises(FileExistsError, match="already holds"):
        claim_store(uri, run="second", options=StartOptions())
    lease = claim_store(uri, run="second", options=StartOptions(overwrite=True))
    assert LayerStore.open(uri).versions() == ()
    lease.release()
    with pytest.raises(UnsafeStoreError, match=r"bucket root.*runs/NAME\?endpoint_override="):
        clear_run(StoreFS.open(f"s3://{s3.bucket}?endpoint_override={s3.endpoint}&scheme=http"))


def test_an_s3_outage_fails_writes_and_commits_and_loses_nothing(s3):
    # credentials in the URI (pyarrow reads them from there) must not reach a message
    store = LayerStore.open(s3.uri("runs/outage", credentials="lc-uri-key:lc-uri-secret", **FAST_FAIL))
    for layer in LAYERS:
        write_layer(store, layer, 10)
    write_layer(store, "block.0", 20)
    committed = store.versions()
    receipts = [store.write_shard(shard) for shard in _shards("norm", 30)]  # written, not committed

    s3.proxy.cut()
    with pytest.raises(StoreWriteError) as shard_error:
        returns(write_layer, store, "block.0", 30)
    with pytest.raises(StoreWriteError) as commit_error:
        returns(store.commit, receipts)
    for error, where in ((shard_error, "layers/block.0/0000000030-"), (commit_error, "manifest/norm@0000000030")):
        message = str(error.value)
        assert where in message and f"s3://{s3.bucket}/runs/outage/" in message, message
        assert "NETWORK_CONNECTION" in message, message  # the cause, as the S3 client reports it
        assert "lc-uri-" not in message and "lc-dummy" not in message  # no credentials

    s3.proxy.restore()
    assert store.versions() == committed  # nothing committed before the outage is lost
    store.commit(receipts)  # the shards written before it still commit
    write_layer(store, "block.0", 40)
    resolved = resolve_plan(store, LAYERS)
    assert {layer: r.step for layer, r in resolved.records.items()} == {"embed": 10, "block.0": 40, "norm": 30}
    assert_loads(store, resolved.records["block.0"], "block.0")


def _shards(layer, step):
    state = layer_state(PARAMS, seed=seed_of(layer, step))
    return cut_shards(layer, step, PARAMS, state, even_cuts(sum(math.prod(s) for s in PARAMS.values()), 2))


def test_s3_client_options_are_taken_from_the_uri(s3):
    opened = open_uri(s3.uri("runs/x", **FAST_FAIL))
    _, (options,) = opened.fs.__reduce__()
    assert options["connect_timeout"] == 1.0 and options["request_timeout"] == 2.0
    assert options["endpoint_override"] == s3.endpoint and opened.root == f"{s3.bucket}/runs/x"
    assert "retry_max_attempts=2" in opened.query
    with pytest.raises(ConfigError, match="connect_timeout='soon'"):
        open_uri(s3.uri("runs/x", connect_timeout="soon"))
    with pytest.raises(ConfigError, match="s3:// storage only"):
        open_uri("gs://bucket/run?connect_timeout=1")


def test_uris_in_messages_show_no_credentials():
    shown = redact_uri("s3://AKIA:SECRET@bucket/run?endpoint_override=h:1&sig=abc&x-amz-security-token=t")
    assert shown == "s3://bucket/run?endpoint_override=h:1&sig=***&x-amz-security-token=***"
    assert redact_uri("/tmp/a?b") == "/tmp/a?b"


def test_run_json_on_s3_keeps_the_storage_uri_whole(s3):
    uri = s3.uri("runs/{name}", **FAST_FAIL)
    config = load_run_config("examples/demo.toml", {"storage": uri, "metrics.port": 0}).with_absolute_storage()
    lease = open_run_store(config, StartOptions())
    try:
        stored = json.loads(LayerStore.open(config.storage_uri).fs.read_bytes(RUN_CONFIG_FILE))
    finally:
        lease.release()
    assert stored["storage"] == uri and config.storage_uri == uri.replace("{name}", "demo")
