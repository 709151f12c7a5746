"""Shared fixtures: a loopback S3-compatible server (moto) behind a proxy a test can cut; a
private temporary directory for the local Ray of a `layercheck train` subprocess; a local Ray in
this process for the tests that call ``train()``; an empty layer store; and the runs several
test modules read (each made once per session, on first use)."""

import os
import shutil

import pytest
from hypothesis import settings

from layercheck.orchestrator.store.layer_store import LayerStore
from tests.support import ray_runs
from tests.support.bench_runs import tiny_benchmark_run
from tests.support.ray_runs import ensure_local_ray, private_ray_tmp, release_local_ray
from tests.support.s3_server import S3_ENV, LoopbackS3, new_bucket, start_moto

# The same examples on every run: a property test that fails, fails for everyone (and a new
# counterexample is found by raising max_examples on purpose, not by CI's luck).
settings.register_profile("layercheck", derandomize=True, print_blob=True)
settings.load_profile("layercheck")


_OWN_RAY_TMP = "LAYERCHECK_TESTS_RAY_TMPDIR"


def pytest_configure(config):
    """This test process's own Ray (``local_ray``; a subprocess's that starts one) keeps Ray's
    files, and the address file a bare ``ray.init()`` joins, in a folder of its own: under
    pytest-xdist each worker's in-process Ray is apart from the other's (in the shared default
    folder, Ray's placement-group cleaner of one found both and failed). A ``RAY_TMPDIR`` the user
    set is kept; one inherited from the pytest-xdist controller (``_OWN_RAY_TMP``) is not."""
    user = os.environ.get("RAY_TMPDIR")
    if user is not None and user != os.environ.get(_OWN_RAY_TMP):
        return
    config.ray_tmp = private_ray_tmp()
    os.environ["RAY_TMPDIR"] = os.environ[_OWN_RAY_TMP] = str(config.ray_tmp)


def pytest_unconfigure(config):
    if getattr(config, "ray_tmp", None) is not None:
        os.environ.pop("RAY_TMPDIR", None)
        os.environ.pop(_OWN_RAY_TMP, None)
        shutil.rmtree(config.ray_tmp, ignore_errors=True)


@pytest.fixture(scope="session")
def moto_server():
    """moto's server on a free loopback port, once per session; yields its (host, port)."""
    server, target = start_moto()
    yield target
    server.stop()


@pytest.fixture
def s3(moto_server, monkeypatch) -> LoopbackS3:
    """A fresh bucket on the loopback S3 server, reached through a proxy the test can cut; dummy
    credentials and region in the environment (subprocesses started by the test inherit them)."""
    for key, value in S3_ENV.items():
        monkeypatch.setenv(key, value)
    for key in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(key, raising=False)
    bucket = new_bucket(moto_server)
    yield bucket
    bucket.proxy.close()


@pytest.fixture
def ray_tmp():
    """A private ``RAY_TMPDIR`` (short: Ray's socket paths must fit in 107 bytes), removed after."""
    path = private_ray_tmp()
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def local_ray():
    """A local Ray in this process for a test that calls ``train()`` (tests/support/ray_runs.py):
    started by the first such test, kept while the next test asks for it too, shut down after
    the last of a row (``pytest_runtest_teardown`` below)."""
    ensure_local_ray()


#: The session fixtures that cost a run each (a Ray run, a 2-rank spawn): every test that reads one
#: goes to the same pytest-xdist worker, so each is made once.
SHARED_RUNS = ("clean_run", "layercheck_run", "tiny_benchmark", "local_runtime", "tied_llama_jobs")


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's, which reads the groups into the tests' ids
def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist (``./dev test -n 2``; ``--dist loadgroup``): the tests that read a
    shared run (``SHARED_RUNS``) in one group per run, so that each is made once, on one worker;
    every other test in its file's group, so that a file's module fixtures are made once too."""
    if not config.pluginmanager.hasplugin("xdist"):
        return
    parent: dict[str, str] = {}

    def root(node: str) -> str:
        while parent.setdefault(node, node) != node:
            node = parent[node]
        return node

    def runs(item) -> list[str]:
        return [name for name in SHARED_RUNS if name in item.fixturenames]

    for item in items:  # a test that reads two runs joins their groups
        first, *others = runs(item) or [item.path.name]
        for other in others:
            parent[root(other)] = root(first)
    for item in items:
        item.add_marker(pytest.mark.xdist_group(root((runs(item) or [item.path.name])[0])))


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    if nextitem is None or "local_ray" not in nextitem.fixturenames:
        release_local_ray()  # no Ray left running for tests that start their own, or none


@pytest.fixture(scope="session")
def clean_run(tmp_path_factory):
    """The failure-free demo run, every layer persisted every step (tests/support/ray_runs.py):
    the reference of the end-to-end recovery tests and of the export after a writer's death."""
    return ray_runs.clean_run(tmp_path_factory.mktemp("clean"))


@pytest.fixture(scope="session")
def layercheck_run(tmp_path_factory):
    """The demo under the ``layercheck`` policy with a worker SIGKILLed after step 8, scraped by a
    real Prometheus (tests/support/ray_runs.py): ``(result, prometheus or None, why none, its
    directory)``; read by the end-to-end tests and the live Prometheus tests. The Prometheus
    server stops at the end of the session."""
    root = tmp_path_factory.mktemp("layercheck-run")
    result, prometheus, missing = ray_runs.layercheck_run(root)
    yield result, prometheus, missing, root
    if prometheus is not None:
        prometheus.stop()


@pytest.fixture
def store(tmp_path) -> LayerStore:
    """An empty layer store in the test's temporary directory."""
    return LayerStore.open(str(tmp_path / "store"))


@pytest.fixture(scope="session")
def tiny_benchmark(tmp_path_factory):
    """The tiny benchmark run the harness and capture tests check (tests/support/bench_runs.py),
    once per session: (workload, raw results, its partial-results file)."""
    return tiny_benchmark_run(tmp_path_factory.mktemp("tiny-benchmark") / "partial.json")


@pytest.fixture(scope="session")
def local_runtime(tmp_path_factory):
    """The local (no Ray) runtime's 2-rank jobs, one after the other in one spawn: the loop's
    scenarios (tests/orchestrator/local/test_local_loop.py) and the write budget's runs
    (tests/orchestrator/local/test_local_write_budget.py); ``{"loop": per-rank results, "budget": per-rank results}``."""
    from tests.support import budget_jobs, local_jobs
    from tests.support.dist_harness import run_jobs

    root = tmp_path_factory.mktemp("local-runtime")
    (root / "loop").mkdir()
    (root / "budget").mkdir()
    loop, budget = run_jobs(
        2,
        [
            (local_jobs.loop_scenarios, (str(root / "loop"),)),
            (budget_jobs.budget_job, (str(root / "budget"), budget_jobs.CAP)),
        ],
    )
    return {"loop": loop, "budget": budget}


@pytest.fixture(scope="session")
def tied_llama_jobs(tmp_path_factory):
    """The 2-rank jobs on the tied-embedding Llama, one after another in one spawn:
    ``store``: ``train_and_store_job`` at ZeRO-3 (tests/support/composite_jobs.py) wrote
    ``(store uri, expected-values dir, the saver's probe loss at each persisting step)``, with its
    ``run.json`` (tests/workers/test_composite_reslice.py and tests/orchestrator/offline/test_export_deepspeed.py only read it);
    ``overlay``: the capture-overlay job's results (tests/workers/test_capture_overlay.py); ``capture``:
    ``{zero stage: the capture job's results}``, ZeRO-0 (tests/workers/test_capture_pieces.py)."""
    from tests.support import capture_jobs, composite_jobs, overlay_jobs
    from tests.support.dist_harness import run_jobs

    root = tmp_path_factory.mktemp("tied-llama")
    store, expect = root / "store", root / "expected"
    expect.mkdir()
    trained, overlay, capture = run_jobs(
        2,
        [
            (composite_jobs.train_and_store_job, (str(store), str(expect))),
            (overlay_jobs.capture_overlay_job, (str(root / "overlay-store"),)),
            (capture_jobs.capture_job, (0,)),
        ],
    )
    composite_jobs.write_run_json(str(store), composite_jobs.run_config())
    probe_loss = {int(t): loss for t, loss in trained[0]["probe_loss"].items()}
    return {"store": (str(store), str(expect), probe_loss), "overlay": overlay, "capture": {0: capture}}
