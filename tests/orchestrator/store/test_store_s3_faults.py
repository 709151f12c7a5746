"""Object-store faults tried as a user meets them, on the loopback S3 server (moto, the real pyarrow
S3 client): wrong credentials (moto enforcing IAM), and an endpoint failing on and off (a proxy
cut for a second every few seconds). Rows of the reliability page's fault-injection matrix."""

import math
import re

import pyarrow.fs as pafs
import pytest
import ray  # noqa: F401 - at collection: Ray's log handler keeps the stderr it was made with, not a test's capture

from layercheck.orchestrator.cli.main import main
from layercheck.orchestrator.core.persistence.commit_path import CommitFailed, CommitPath, CommitSucceeded, ShardWritten
from layercheck.orchestrator.core.recovery.config import SupervisionConfig
from layercheck.orchestrator.core.run_start import StartOptions, claim_store
from layercheck.orchestrator.runtime import driver
from layercheck.orchestrator.store.errors import StoreAccessError, StoreUnavailableError
from layercheck.orchestrator.store.fs import StoreFS
from layercheck.orchestrator.store.layer_store import LayerStore
from layercheck.orchestrator.store.recovery_source import VersionReader, resolve_plan
from tests.support.s3_server import FAST_FAIL, CuttableProxy, LoopbackS3, flapping, iam_enforced, throttled_s3
from tests.support.store_helpers import (
    PARAMS,
    FaultyLocalFS,
    cut_shards,
    even_cuts,
    layer_state,
    seed_of,
    write_layer,
)

LAYERS = {"embed": 48, "block.0": 48, "norm": 48}
WRONG_SECRET = "lc-wrong-secret-0123456789"
#: How the S3 client names a refused signature or key (the cause the user must see).
REFUSED = re.compile(r"SIGNATURE_DOES_NOT_MATCH|ACCESS_DENIED|INVALID_ACCESS_KEY_ID")


def _bucket_files(s3, good: dict[str, str], monkeypatch) -> list[str]:
    """Every object in the test's bucket, listed with the right credentials."""
    for key, value in good.items():
        monkeypatch.setenv(key, value)
    selector = pafs.FileSelector(s3.bucket, recursive=True, allow_not_found=True)
    return [i.path for i in s3.filesystem().get_file_info(selector) if i.type == pafs.FileType.File]


def _one_error_line(text: str, prefix: str) -> str:
    lines = [line for line in text.splitlines() if line.startswith(prefix)]
    assert len(lines) == 1, text
    return lines[0]


@pytest.mark.slow
def test_wrong_s3_credentials_stop_train_with_one_line_before_anything_is_written(s3, moto_server, monkeypatch, capsys):
    """`layercheck train` (and a LayerCheckTrainer's claim of its store) with the right key id and a
    wrong secret: refused at the driver's first store operation with one line naming the store
    and the cause; no traceback, no secret, no Ray, nothing written in the bucket."""
    with iam_enforced(moto_server) as good:
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", good["AWS_ACCESS_KEY_ID"])
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", WRONG_SECRET)
        # refused before the cluster, so before any worker (this process's Ray may be up already)
        monkeypatch.setattr(driver, "connect", lambda config: pytest.fail("joined Ray before the store refused"))
        code = main(["train", "examples/demo.toml", "--set", f"storage={s3.uri('runs/{name}')}"])
        out, err = capsys.readouterr()
        assert code == 2, out + err
        line = _one_error_line(err, "layercheck train:")
        assert f"s3://{s3.bucket}/runs/demo" in line and REFUSED.search(line) and "credentials" in line, line
        assert "Traceback" not in out + err and WRONG_SECRET not in out + err

        with pytest.raises(StoreAccessError) as refused:  # LayerCheckTrainer.fit's first store operation
            claim_store(s3.uri("runs/own"), run="own", options=StartOptions())
        assert f"s3://{s3.bucket}/runs/own" in str(refused.value) and REFUSED.search(str(refused.value))
        assert WRONG_SECRET not in str(refused.value)
        assert _bucket_files(s3, good, monkeypatch) == []


def test_wrong_s3_credentials_fail_the_store_commands_with_one_line(s3, moto_server, monkeypatch, capsys):
    """inspect, verify, gc and export of a run with a wrong secret in the environment, or wrong
    credentials in the URI: exit 2 with one line naming the store (never the credentials) and the
    cause; the run is untouched."""
    with iam_enforced(moto_server) as good:
        for key, value in good.items():
            monkeypatch.setenv(key, value)
        write_layer(LayerStore.open(s3.uri("runs/a")), "embed", 10)
        before = _bucket_files(s3, good, monkeypatch)
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", WRONG_SECRET)
        for uri in (s3.uri("runs/a"), s3.uri("runs/a", credentials="lc-uri-key:lc-uri-secret")):
            for command in (["inspect"], ["verify"], ["gc", "--grace", "0"], ["export", "--format", "hf"]):
                args = [command[0], uri, *command[1:]] + (["--out", "unused-out"] if command[0] == "export" else [])
                assert main(args) == 2, args
                out, err = capsys.readouterr()
                line = _one_error_line(out, "error:")
                assert f"s3://{s3.bucket}/runs/a" in line and REFUSED.search(line) and "credentials" in line, line
                for secret in (WRONG_SECRET, "lc-uri-secret", "lc-uri-key"):
                    assert secret not in out + err, (args, out + err)
                assert "Traceback" not in out + err
        assert _bucket_files(s3, good, monkeypatch) == before


def _missing_bucket(s3) -> str:
    """``s3://nosuchbucket/run`` on the loopback server: a bucket nobody created."""
    return s3.uri("run").replace(f"s3://{s3.bucket}/", "s3://nosuchbucket/")


def _no_such_bucket_made(s3) -> bool:
    return s3.filesystem().get_file_info("nosuchbucket").type == pafs.FileType.NotFound


def test_a_missing_bucket_fails_the_store_commands_and_a_runs_start_with_one_line(s3, capsys, tmp_path):
    """Storage ``s3://nosuchbucket/run``: inspect, verify, gc and export exit 2 with one line naming
    the store, no traceback; a run's start (``layercheck train``'s lease and ``LayerCheckTrainer``'s
    claim: the first write) fails naming the lease file and that the bucket was not found. No
    bucket is created, nothing written."""
    from layercheck.orchestrator.store.errors import StoreWriteError

    uri = _missing_bucket(s3)
    for command in (["inspect"], ["verify"], ["gc", "--grace", "0"], ["export", "--format", "hf"]):
        args = [command[0], uri, *command[1:]] + (["--out", str(tmp_path / "out")] if command[0] == "export" else [])
        assert main(args) == 2, args
        out, err = capsys.readouterr()
        line = _one_error_line(out, "error:")
        assert "s3://nosuchbucket/run" in line and ("no store at" in line or "no committed" in line), line
        assert "Traceback" not in out + err
    with pytest.raises(StoreWriteError, match=r"s3://nosuchbucket/run/owner\.json.*Bucket 'nosuchbucket' not found"):
        claim_store(uri, run="run", options=StartOptions())
    assert _no_such_bucket_made(s3) and not (tmp_path / "out").exists()


@pytest.mark.slow
def test_a_missing_bucket_stops_train_with_one_line_before_any_worker(s3, capsys):
    """``layercheck train`` with ``storage = s3://nosuchbucket/run``: exit 2 with one line naming the
    lease file and that the bucket was not found; no traceback, no bucket made. A missing bucket
    reads as an empty store, so the start gets as far as its first write: the lease, taken after
    Ray was joined and before any worker is started."""
    code = main(["train", "examples/demo.toml", "--set", f"storage={_missing_bucket(s3)}", "--set", "metrics.port=0"])
    out, err = capsys.readouterr()
    assert code == 2, out + err
    line = _one_error_line(err, "layercheck train:")
    assert "s3://nosuchbucket/run/owner.json" in line and "Bucket 'nosuchbucket' not found" in line, line
    assert "Traceback" not in out + err and _no_such_bucket_made(s3)


def _shards(layer: str, step: int):
    state = layer_state(PARAMS, seed=seed_of(layer, step))
    return cut_shards(layer, step, PARAMS, state, even_cuts(sum(math.prod(s) for s in PARAMS.values()), 2))


def _write_and_commit(store: LayerStore, commits: CommitPath, layer: str, step: int) -> str:
    """One version as the writer path makes it: each rank's shard written (a failed write fails the
    version), the commit tried and retried as :class:`CommitPath` says. "committed", "write failed"
    or "commit failed"."""
    actions = []
    for shard in _shards(layer, step):
        try:
            actions += commits.handle(ShardWritten(receipt=store.write_shard(shard)))
        except OSError:
            return "write failed"
    while actions:
        action = actions.pop(0)
        try:
            commits.handle(CommitSucceeded(record=store.commit(list(action.receipts))))
            return "committed"
        except OSError as error:
            actions += commits.handle(CommitFailed(action=action, error=str(error)))
    return "commit failed"


def _plan_steps(store: LayerStore) -> dict[str, int]:
    return {layer: record.step for layer, record in resolve_plan(store, LAYERS, deep=True).records.items()}


@pytest.mark.slow
def test_an_s3_endpoint_failing_on_and_off_commits_whole_versions_and_never_plans_an_older_one(s3):
    """Versions written through a proxy cut for 1 s every 2 s: each is committed whole or reported
    failed; nothing committed is lost; a recovery planned while the endpoint flaps either gives
    the newest versions or says the storage did not answer (never an older composite, never
    "no usable version"); once it answers again, recovery reads the newest versions back."""
    store = LayerStore.open(s3.uri("runs/flapping", **FAST_FAIL))
    commits = CommitPath(layers=list(LAYERS), config=SupervisionConfig(commit_backoff_s=0.2))
    outcomes: dict[tuple[str, int], str] = {}
    with flapping(s3.proxy, up_s=2.0, down_s=1.0) as outages:
        step = 0
        while len(outages) < 3 and step < 200:
            step += 1
            for layer in LAYERS:
                outcomes[(layer, step)] = _write_and_commit(store, commits, layer, step)
        committed_steps = {
            layer: max(s for (name, s), how in outcomes.items() if name == layer and how == "committed")
            for layer in LAYERS
        }
        planned = []
        for _ in range(8):
            try:
                planned.append(_plan_steps(store))
            except StoreUnavailableError as error:
                assert s3.bucket in str(error) and "runs/flapping" in str(error)
                planned.append(None)
    assert len(outages) >= 3

    versions = store.versions()
    for record in versions:  # never half: every committed version reads back whole
        assert store.check_version(record, deep=True) == [], record.version_id
        assert outcomes[(record.layer, record.step)] != "write failed", record.version_id
    held = {(r.layer, r.step) for r in versions}
    assert {key for key, how in outcomes.items() if how == "committed"} <= held  # nothing committed is lost
    newest = {layer: max(s for name, s in held if name == layer) for layer in LAYERS}
    assert all(newest[layer] >= committed_steps[layer] for layer in LAYERS)
    # a commit reported failed may still have landed (its reply was cut): then it is whole, and newest
    assert all(steps in (None, newest) for steps in planned), planned

    resolved = resolve_plan(store, LAYERS, deep=True)
    assert {layer: r.step for layer, r in resolved.records.items()} == newest and not resolved.skipped
    for layer, record in resolved.records.items():
        with VersionReader(store, record) as reader:
            expected = layer_state(PARAMS, seed=seed_of(layer, record.step))
            assert reader.read("w", "exp_avg", 0, 30).equal(expected["exp_avg"]["w"])


def test_an_s3_endpoint_that_throttles_commits_whole_versions_or_fails_saying_slowdown(s3, monkeypatch):
    """S3 under a request limit (issue 59: ``503 SlowDown`` past it, as a prefix's rate limit does
    to many ranks' writers at once). Three writers writing and committing at once through a limit
    of 30 requests a second: the client backs off and retries, so every version is committed and
    reads back whole, and the server did refuse requests. Then a limit of 0: a write fails once
    the store has backed off for ``THROTTLED_FOR_S`` (shortened here), with an error that says
    SlowDown (what the writer reports; the run then stops on the staleness breach or warns, as for
    any storage failure), never a hang."""
    import threading
    import time

    from layercheck.orchestrator.store import fs

    with throttled_s3(30) as (target, limit):
        throttled = LoopbackS3(proxy=CuttableProxy(target), bucket=s3.bucket)
        store = LayerStore.open(throttled.uri("runs/throttled"))  # LayerCheck's own client limits
        outcomes: dict[tuple[str, int], str] = {}

        def writer(layer: str) -> None:
            commits = CommitPath(layers=[layer], config=SupervisionConfig(commit_backoff_s=0.2))
            for step in (1, 2):
                outcomes[(layer, step)] = _write_and_commit(store, commits, layer, step)

        writers = [threading.Thread(target=writer, args=(layer,)) for layer in LAYERS]
        for thread in writers:
            thread.start()
        for thread in writers:
            thread.join(timeout=300)
        assert limit.refused > 0, "the limit was never reached: the test did not throttle"
        assert set(outcomes.values()) == {"committed"}, outcomes
        limit.per_second = 1000  # (read back unthrottled)
        versions = store.versions()
        assert len(versions) == len(outcomes)
        assert all(store.check_version(record, deep=True) == [] for record in versions)
        throttled.proxy.close()

    monkeypatch.setattr(fs, "THROTTLED_FOR_S", 2.0)
    with throttled_s3(0) as (target, limit):
        refused = LoopbackS3(proxy=CuttableProxy(target), bucket=s3.bucket)
        store = LayerStore.open(refused.uri("runs/refused", **FAST_FAIL))
        began = time.monotonic()
        with pytest.raises(OSError, match="kept throttling it, HTTP 503 SlowDown"):
            store.write_shard(_shards("embed", 1)[0])
        assert time.monotonic() - began < 30
        refused.proxy.close()
    assert limit.served == 0 and limit.refused > 0


class _DroppedReads(FaultyLocalFS):
    """A local filesystem whose reads of paths containing ``dropped`` fail as the S3 client's do
    when its connection is reset (a fault scripted at an exact file, the rest reads normally)."""

    def __init__(self) -> None:
        super().__init__()
        self.dropped = ""

    def _check_readable(self, path: str) -> None:
        if self.dropped and self.dropped in path:
            raise OSError(
                f"When reading information for key '{path}': AWS Error NETWORK_CONNECTION during GetObject "
                "operation: curlCode: 56, Failure when receiving data from the peer"
            )

    def open_input_stream(self, path):
        self._check_readable(path)
        return super().open_input_stream(path)

    def open_input_file(self, path):
        self._check_readable(path)
        return super().open_input_file(path)


def test_a_record_or_shard_the_storage_did_not_return_is_not_taken_for_damage(tmp_path, capsys):
    """A read the storage failed (its connection reset) says nothing about the file: recovery,
    and ``check_version`` raise that the storage did not answer, instead of
    planning from an older version or calling the newest one damaged."""
    handler = _DroppedReads()
    store = LayerStore(StoreFS(fs=pafs.PyFileSystem(handler), root=str(tmp_path / "run")))
    for step in (10, 20):
        for layer in LAYERS:
            write_layer(store, layer, step)
    newest = store.versions()[-1]  # norm@20
    for dropped in ("manifest/norm@0000000020", newest.shards[1].path):
        handler.dropped = dropped
        with pytest.raises(StoreUnavailableError, match="NETWORK_CONNECTION") as raised:
            resolve_plan(store, LAYERS, deep=True)
        assert str(tmp_path / "run") in str(raised.value)
    with pytest.raises(StoreUnavailableError):
        store.check_version(newest, deep=True)
    handler.dropped = ""
    assert _plan_steps(store) == dict.fromkeys(LAYERS, 20)
