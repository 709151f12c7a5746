"""What the driver checks before a run writes anything or starts a worker: the config (data,
model, non-finite numbers), the storage location, the store's lease, an honest --resume, a safe
--overwrite. No Ray: every refusal here comes first."""

import json
import logging
from pathlib import Path

import pytest

from layercheck.orchestrator.cli.main import main
from layercheck.orchestrator.core.run_config import load_run_config
from layercheck.orchestrator.core.run_start import (
    ResumeError,
    StartOptions,
    check_config,
    check_resumable,
    claim_store,
    open_run_store,
)
from layercheck.orchestrator.store.errors import StoreBusyError, UnsafeStoreError
from layercheck.orchestrator.store.fs import StoreFS
from layercheck.orchestrator.store.initial_state import read_initial, record_initial
from layercheck.orchestrator.store.layer_store import LayerStore
from layercheck.orchestrator.store.lease import read_lease
from layercheck.policies.config_loader import ConfigError
from tests.support.store_helpers import relabel_version, write_layer

DEMO = Path(__file__).resolve().parents[3] / "examples" / "demo.toml"
LAYERS = ("embed", "block.0", "block.1", "block.2", "block.3", "norm", "lm_head")


def _config(tmp_path, **overrides):
    return load_run_config(DEMO, {"storage": str(tmp_path / "run"), **overrides}).with_absolute_storage()


def _stored_run(root, *, step=40):
    store = LayerStore.open(str(root), fsync=False)
    records = {}
    for layer in LAYERS:
        records[layer], _ = write_layer(store, layer, 20, base=True)
    records["block.1@40"], _ = write_layer(store, "block.1", step)
    return store, records


@pytest.mark.parametrize(
    "overrides,field",
    [
        ({"model.hf_config.model_type": "lama"}, "model.hf_config.model_type"),
        ({"model.hf_config": None, "model.path": "/nonexistent/model"}, "model.path"),
        ({"model.hf_config.hidden_size": 63}, "model.hf_config"),  # 63 heads of 4: transformers refuses
    ],
)
def test_model_errors_name_the_field_before_anything_is_written(tmp_path, overrides, field):
    store, _ = _stored_run(tmp_path / "run")
    before = sorted((tmp_path / "run").rglob("*"))
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        open_run_store(_config(tmp_path, **overrides), StartOptions(overwrite=True))
    assert sorted((tmp_path / "run").rglob("*")) == before  # --overwrite did not run: the config was bad


def test_a_model_path_without_config_json_is_named(tmp_path):
    (tmp_path / "model").mkdir()
    with pytest.raises(ConfigError, match="model.path: .* no config.json"):
        open_run_store(
            _config(tmp_path, **{"model.hf_config": None, "model.path": str(tmp_path / "model")}), StartOptions()
        )
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "item,message",
    [
        ("policy.ema=Infinity", "policy.ema: must be a finite number"),
        ("optim.lr=NaN", "optim.lr: must be a finite number"),
        ("steps.x=1", "steps is a value"),
        ("policy..smax=1", "empty part"),
    ],
)
def test_bad_overrides_are_config_errors_not_tracebacks(tmp_path, capsys, item, message):
    assert main(["train", str(DEMO), "--set", f"storage={tmp_path / 'run'}", "--set", item]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_a_fresh_run_takes_the_lease_and_writes_run_json(tmp_path):
    lease = open_run_store(_config(tmp_path), StartOptions())
    try:
        assert json.loads((tmp_path / "run" / "run.json").read_text())["name"] == "demo"
        assert read_lease(lease.fs).owner == lease.info.owner
    finally:
        lease.release()
    assert read_lease(lease.fs) is None


def test_a_fresh_run_records_its_initial_state_and_a_resume_keeps_it(tmp_path, caplog):
    """The built-in loop rebuilds the model from run.json on every start: that state is every
    layer's version at step 0, recorded (no weights written) so a layer not saved yet is no hole."""
    config = _config(tmp_path)
    open_run_store(config, StartOptions()).release()
    fs = StoreFS.open(str(tmp_path / "run"))
    layers = list(check_config(config))
    assert read_initial(fs).layers == tuple(layers)
    store, records = _stored_run(tmp_path / "run")
    store.fs.delete(records["norm"].shards[1].path)  # norm's only version loses a shard
    record_initial(fs, LAYERS[1:])  # (all but embed: shows that the resume does not rewrite it)
    with caplog.at_level(logging.WARNING):
        lease = open_run_store(config, StartOptions(resume=True))
    lease.release()
    assert read_initial(fs).layers == LAYERS[1:]  # the first run's record, not rewritten
    assert "norm from the initial state" in caplog.text


def test_a_second_run_of_the_same_store_is_refused_naming_the_owner(tmp_path):
    first = open_run_store(_config(tmp_path), StartOptions())
    try:
        # another host's driver (same host and pid would count as this process's own leftover)
        info = first.info
        other = type(info)(**{**info.__dict__, "host": "node-7", "pid": 99, "run": "first"})
        first.fs.write_bytes("owner.json", json.dumps(other.to_json()).encode())
        with pytest.raises(StoreBusyError, match=r"run 'first' \(pid 99 on node-7"):
            open_run_store(_config(tmp_path), StartOptions(overwrite=True))
        assert (tmp_path / "run" / "run.json").exists()
    finally:
        first.release()


def test_overwrite_keeps_foreign_files_and_refuses(tmp_path):
    _stored_run(tmp_path / "run")
    (tmp_path / "run" / "train.py").write_text("# the user's code")
    with pytest.raises(UnsafeStoreError, match="train.py"):
        open_run_store(_config(tmp_path), StartOptions(overwrite=True))
    assert (tmp_path / "run" / "train.py").exists() and len(LayerStore.open(str(tmp_path / "run")).versions()) == 8
    assert read_lease(LayerStore.open(str(tmp_path / "run")).fs) is None  # released on the refusal


def test_overwrite_deletes_the_earlier_run(tmp_path):
    _stored_run(tmp_path / "run")
    lease = open_run_store(_config(tmp_path), StartOptions(overwrite=True))
    lease.release()
    assert not LayerStore.open(str(tmp_path / "run")).versions()
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["epochs", "initial.json", "run.json"]


def test_without_overwrite_an_existing_run_is_refused(tmp_path):
    _stored_run(tmp_path / "run")
    with pytest.raises(FileExistsError, match="--resume"):
        open_run_store(_config(tmp_path), StartOptions())


def test_empty_storage_is_a_config_error():
    with pytest.raises(ConfigError, match="storage"):
        load_run_config(DEMO, {"storage": ""})


def test_storage_at_the_working_directory_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UnsafeStoreError, match="working directory"):
        open_run_store(load_run_config(DEMO, {"storage": "."}).with_absolute_storage(), StartOptions())
    assert list(tmp_path.iterdir()) == []


def test_resume_with_a_layer_without_usable_version_names_it_and_the_options(tmp_path, capsys):
    store, records = _stored_run(tmp_path / "run")
    store.fs.delete(records["norm"].shards[1].path)  # norm's only version loses a shard
    with pytest.raises(ResumeError) as error:
        open_run_store(_config(tmp_path), StartOptions(resume=True))
    message = str(error.value)
    assert "norm" in message and "missing" in message and "--restart-into" in message
    assert not (tmp_path / "run" / "run.json").exists()
    # the CLI: exit 2, the same message, nothing trained
    assert main(["train", str(DEMO), "--set", f"storage={tmp_path / 'run'}", "--resume"]) == 2
    assert "--resume refused" in capsys.readouterr().err


def test_resume_falls_back_to_an_older_usable_version(tmp_path):
    store, records = _stored_run(tmp_path / "run")
    write_layer(store, "norm", 40)  # the run reached 40 by a version that stays usable
    store.fs.delete(records["block.1@40"].shards[0].path)
    resolved = check_resumable(store, dict.fromkeys(LAYERS, 1), _config(tmp_path))
    assert resolved.records["block.1"].step == 20 and resolved.plan.t_fail == 40


def test_resume_continues_after_the_newest_step_of_versions_it_accepts(tmp_path, caplog):
    """A run stopped after step 21 of 60: embed's step-22 version renamed consistently to step 50
    (record, version id, file names; its files' headers still say 22). ``inspect`` calls 50 the
    newest step, but the plan rejects that version, so ``--resume`` continues at 22, not 51 (which
    would skip 29 steps of data order and learning-rate schedule)."""
    store, _ = _stored_run(tmp_path / "run", step=21)
    renamed = relabel_version(store, write_layer(store, "embed", 22)[0], 50)
    with caplog.at_level(logging.INFO):
        resolved = check_resumable(store, dict.fromkeys(LAYERS, 1), _config(tmp_path, steps=55))
    assert renamed.version_id in resolved.skipped and "('embed', 22" in resolved.skipped[renamed.version_id]
    assert resolved.plan.t_fail == 21 and resolved.records["embed"].step == 20
    assert "continuing at step 22 of 55" in caplog.text and "continuing at step 51" not in caplog.text


def test_resume_at_or_past_steps_is_refused(tmp_path):
    store, _ = _stored_run(tmp_path / "run", step=40)
    with pytest.raises(ConfigError, match="steps: .* already at step 40"):
        check_resumable(store, dict.fromkeys(LAYERS, 1), _config(tmp_path, steps=40))


def test_readme_resume_with_one_worker_validates_and_warns(tmp_path, caplog):
    config = _config(tmp_path, **{"cluster.num_workers": 1})  # the README's command, kill_rank = 1
    _stored_run(tmp_path / "run")
    with caplog.at_level(logging.WARNING):
        lease = open_run_store(config, StartOptions(resume=True))
    lease.release()
    assert "fault.kill_rank = 1 is not a rank of the 1-worker group" in caplog.text


def test_steps_past_the_schedule_warn(tmp_path, caplog):
    with caplog.at_level(logging.WARNING):
        lease = open_run_store(_config(tmp_path, steps=500), StartOptions())
    lease.release()
    assert "optim.total_steps = 120" in caplog.text and "set optim.total_steps = 500" in caplog.text


def test_restart_into_starts_a_fresh_run_in_the_new_store(tmp_path, monkeypatch):
    import layercheck.orchestrator.runtime.driver as driver

    seen = {}

    def fake_train(config, **kwargs):  # only the routing of the flag is under test here
        seen.update(storage=config.storage_uri, **kwargs)
        raise FileExistsError("stop")

    monkeypatch.setattr(driver, "train", fake_train)
    assert main(["train", str(DEMO), "--resume", "--restart-into", str(tmp_path / "new")]) == 2
    assert seen["storage"] == str(tmp_path / "new") and seen["resume"] is False and seen["overwrite"] is False


_HEADS_8_4 = {"model.hf_config.num_attention_heads": 8, "model.hf_config.num_key_value_heads": 4}
_HEADS_2_1 = {"model.hf_config.num_attention_heads": 2, "model.hf_config.num_key_value_heads": 1}


@pytest.mark.parametrize("driver", [True, False], ids=["driver", "under-lease"])
@pytest.mark.parametrize(
    "overrides, changed",
    [
        ({"model.hf_config.num_hidden_layers": 3}, "layers the store has and the model not: block.3"),
        ({"model.hf_config.num_hidden_layers": 6}, "layers the model has and the store not: block.4, block.5"),
        ({"model.hf_config.intermediate_size": 96}, "parameters per layer changed: block.0"),
        # every tensor keeps its shape: only the config fields tell the models apart
        (_HEADS_8_4, "num_attention_heads: 4 -> 8, num_key_value_heads: 2 -> 4, head_dim: 16 -> 8"),
        (_HEADS_2_1, "num_attention_heads: 4 -> 2, num_key_value_heads: 2 -> 1, head_dim: 16 -> 32"),
        # tied, the head is no layer of its own: named as a field as well as a missing layer
        ({"model.hf_config.tie_word_embeddings": True}, "tie_word_embeddings: False -> True"),
    ],
    ids=["fewer-blocks", "more-blocks", "other-sizes", "heads-8-4", "heads-2-1", "tied"],
)
def test_resume_with_another_model_is_refused_before_anything_is_written(tmp_path, overrides, changed, driver):
    """``driver``: as ``layercheck train`` starts (the read-only checks before the lease: nothing
    at all is written); else the check under the lease, which is released again."""
    open_run_store(_config(tmp_path), StartOptions()).release()  # the run's own run.json
    _stored_run(tmp_path / "run")
    before = (tmp_path / "run" / "run.json").read_bytes()
    files = {p: p.read_bytes() for p in sorted((tmp_path / "run").rglob("*")) if p.is_file()}
    with pytest.raises(ResumeError, match="is not the one the run in") as error:
        open_run_store(
            _config(tmp_path, **overrides), StartOptions(resume=True), before_write=(lambda: None) if driver else None
        )
    assert changed in str(error.value) and "--restart-into" in str(error.value)
    assert "\n" not in str(error.value)  # one line
    assert (tmp_path / "run" / "run.json").read_bytes() == before  # not replaced
    assert not (tmp_path / "run" / "run.previous.json").exists()
    assert not (tmp_path / "run" / "model.json").exists()
    assert read_lease(StoreFS.open(str(tmp_path / "run"))) is None  # no lease left behind
    if driver:
        assert {p: p.read_bytes() for p in sorted((tmp_path / "run").rglob("*")) if p.is_file()} == files


def test_resume_of_an_own_loops_store_compares_its_model_json(tmp_path):
    """A store an own loop wrote has no run.json: ``layercheck train --resume`` compares the config
    with the model its driver recorded (``model.json``), field by field."""
    import transformers

    from layercheck.orchestrator.store.model_record import describe_model, write_model_record

    store, _ = _stored_run(tmp_path / "run")
    hf = dict(_config(tmp_path).model.hf_config)
    write_model_record(store.fs, describe_model(transformers.AutoConfig.for_model(hf.pop("model_type"), **hf)))
    record = (tmp_path / "run" / "model.json").read_bytes()
    with pytest.raises(ResumeError, match="num_attention_heads: 4 -> 8, num_key_value_heads: 2 -> 4") as error:
        open_run_store(_config(tmp_path, **_HEADS_8_4), StartOptions(resume=True), before_write=lambda: None)
    assert "model.json" in str(error.value)
    assert not (tmp_path / "run" / "run.json").exists() and (tmp_path / "run" / "model.json").read_bytes() == record
    assert read_lease(store.fs) is None
    open_run_store(_config(tmp_path), StartOptions(resume=True)).release()  # its own model resumes


def test_a_resume_keeps_the_config_it_resumed_from(tmp_path):
    open_run_store(_config(tmp_path), StartOptions()).release()
    _stored_run(tmp_path / "run")
    first = (tmp_path / "run" / "run.json").read_bytes()
    open_run_store(_config(tmp_path, steps=300), StartOptions(resume=True)).release()
    assert (tmp_path / "run" / "run.previous.json").read_bytes() == first
    assert json.loads((tmp_path / "run" / "run.json").read_text())["steps"] == 300


def _tree(root):
    return {str(p.relative_to(root)): p.read_bytes() if p.is_file() else None for p in root.rglob("*")}


def test_a_run_inside_another_runs_directory_is_refused_before_anything_is_written(tmp_path):
    """A store nested in another run's tree is that run's to collect (gc, --overwrite): refused at
    start, by `layercheck train` (open_run_store) and an own loop's LayerCheckTrainer (claim_store)."""
    claim_store(str(tmp_path / "runs" / "a"), run="a", options=StartOptions()).release()  # its epoch
    _stored_run(tmp_path / "runs" / "a")
    before = _tree(tmp_path / "runs")
    inner = tmp_path / "runs" / "a" / "layers" / "exp2"
    with pytest.raises(UnsafeStoreError, match="lies inside the LayerCheck run in") as error:
        open_run_store(
            load_run_config(DEMO, {"storage": str(inner)}).with_absolute_storage(),
            StartOptions(),
            before_write=pytest.fail,
        )
    assert str(inner) in str(error.value) and f"run in {tmp_path / 'runs' / 'a'} (" in str(error.value)
    assert "\n" not in str(error.value) and str(tmp_path / "runs" / "exp2") in str(error.value)  # where to go
    with pytest.raises(UnsafeStoreError, match="lies inside"):
        claim_store(str(inner), run="exp2", options=StartOptions())
    assert _tree(tmp_path / "runs") == before


@pytest.mark.parametrize("resume", [False, True], ids=["fresh", "resume"])
def test_a_run_directory_holding_another_run_below_it_is_refused(tmp_path, resume):
    inner = tmp_path / "runs" / "b" / "layers" / "exp2"
    claim_store(str(inner), run="exp2", options=StartOptions()).release()
    _stored_run(inner)
    outer = tmp_path / "runs" / "b"
    if resume:
        _stored_run(outer)
    before = _tree(tmp_path / "runs")
    with pytest.raises(UnsafeStoreError, match="contains another LayerCheck run in") as error:
        claim_store(str(outer), run="b", options=StartOptions(resume=resume))
    assert str(inner) in str(error.value) and "\n" not in str(error.value)
    assert _tree(tmp_path / "runs") == before


def test_directories_named_like_a_runs_but_not_layercheck_s_are_no_run(tmp_path):
    """Only LayerCheck's own names mark a run: another tool's epochs/, manifest/ or run.json above
    or below the storage does not refuse it."""
    for where in (tmp_path / "project", tmp_path / "out" / "tool"):
        (where / "epochs").mkdir(parents=True)
        (where / "epochs" / "epoch_1.pt").write_bytes(b"another tool's")
        (where / "manifest").mkdir()
        (where / "manifest" / "deploy.json").write_text("{}")
        (where / "run.json").write_text("{}")
    claim_store(str(tmp_path / "project" / "runs" / "x"), run="x", options=StartOptions()).release()
    claim_store(str(tmp_path / "out"), run="y", options=StartOptions()).release()


_RESUMER = """
import sys, time
from layercheck.orchestrator.core.run_config import load_run_config
from layercheck.orchestrator.core.run_start import StartOptions, open_run_store
from layercheck.orchestrator.store.errors import StoreBusyError
config = load_run_config(sys.argv[1], {"storage": sys.argv[2], "name": sys.argv[3]}).with_absolute_storage()
print("ready", flush=True)
start = float(sys.stdin.readline())
while time.time() < start:
    pass
try:
    lease = open_run_store(config, StartOptions(resume=True))
except StoreBusyError as error:
    print("refused:", error, flush=True)
else:
    print("resumed", flush=True)
    time.sleep(3)  # a live run: the other start must see its lease, not a dead process's
    lease.release()
"""


@pytest.mark.slow
def test_two_resumes_of_a_killed_runs_store_started_together_get_one_owner(tmp_path):
    """``layercheck train --resume`` twice on the store of a run whose driver was killed (its lease
    names a process gone from this host, so both find it stale), started at the same moment in two
    processes, as far as each start's checks and lease (no Ray): one resumes, the other is refused
    naming it, and only one epoch is opened over the killed run's."""
    import os
    import socket
    import subprocess
    import sys
    import time

    from layercheck.orchestrator.store.epochs import epoch_numbers
    from tests.support.store_helpers import foreign_lease

    open_run_store(_config(tmp_path), StartOptions()).release()  # the killed run's start: epoch 1
    _stored_run(tmp_path / "run")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    fs = StoreFS.open(str(tmp_path / "run"), fsync=False)
    foreign_lease(fs, host=socket.gethostname(), pid=dead.pid)  # what its SIGKILL left
    env = {**os.environ, "PYTHONPATH": str(DEMO.parents[1])}
    resumers = [
        subprocess.Popen(
            [sys.executable, "-c", _RESUMER, str(DEMO), str(tmp_path / "run"), f"resume{i}"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=env,
        )
        for i in range(2)
    ]
    for resumer in resumers:  # both imported and configured: the start below is the same moment
        assert resumer.stdout.readline().strip() == "ready"
    start = time.time() + 0.5
    for resumer in resumers:
        resumer.stdin.write(f"{start}\n")
        resumer.stdin.flush()
    outcomes = {f"resume{i}": resumer.communicate(timeout=120)[0].strip() for i, resumer in enumerate(resumers)}
    (winner,) = [name for name, said in outcomes.items() if said == "resumed"]
    (loser,) = set(outcomes) - {winner}
    assert outcomes[loser].startswith("refused:") and f"run '{winner}'" in outcomes[loser], outcomes
    assert epoch_numbers(fs) == [1, 2]
