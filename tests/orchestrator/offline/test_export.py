"""``layercheck export --format hf`` and the export's errors, on a store written in-process (no
DeepSpeed): every layer of a tiny tied-embedding Llama as a base at step 10 and some layers again
at 20; and ``inspect``/``verify``/``gc`` on a store with ``run.json`` at its root."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch
import transformers

from layercheck.orchestrator.cli.main import main
from layercheck.orchestrator.offline.export_deepspeed import export_deepspeed
from layercheck.orchestrator.offline.export_hf import composite_model
from layercheck.orchestrator.offline.export_run import ExportError, plan_export, run_config_of
from layercheck.orchestrator.offline.exporter import export
from layercheck.orchestrator.store.gc import GcConfig, collect_garbage
from layercheck.orchestrator.store.layer_store import DRIFT_TRACE_FILE, RUN_CONFIG_FILE, LayerStore
from layercheck.policies.layer_map import layer_map_of
from layercheck.workers.engine import build_model
from layercheck.workers.shard import STATE_KEYS
from tests.support import composite_jobs as jobs
from tests.support.models import tiny_llama
from tests.support.store_helpers import cut_shards, even_cuts

NEWER = ("embed", "block.1")  # persisted again at step 20


def _write_layer(store: LayerStore, layer, step: int, *, base: bool, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    params = {p.name: p.shape for p in layer.params}
    state = {
        key: {name: torch.randn(math.prod(shape), generator=gen) for name, shape in params.items()}
        for key in STATE_KEYS
    }
    store.write_version(cut_shards(layer.name, step, params, state, even_cuts(layer.numel, 2)), base=base)
    return state["fp32"]


@pytest.fixture
def run(tmp_path):
    """(store uri, fp32 weights of the composite at 20, at 15)."""
    uri = str(tmp_path / "run")
    store = LayerStore.open(uri, fsync=False)
    jobs.write_run_json(uri, jobs.run_config())
    layer_map = layer_map_of(build_model(jobs.run_config().model))
    at15, at20 = {}, {}
    for i, layer in enumerate(layer_map.layers):
        weights = _write_layer(store, layer, 10, base=True, seed=i)
        at15.update(weights)
        at20.update(_write_layer(store, layer, 20, base=False, seed=100 + i) if layer.name in NEWER else weights)
    return uri, at20, at15


def _logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=jobs.probe_batch()).logits


def test_hf_export_loads_with_from_pretrained_and_gives_the_composites_logits(run, tmp_path):
    uri, at20, _ = run
    out = tmp_path / "hf"
    assert main(["export", uri, "--format", "hf", "--out", str(out)]) == 0
    assert (out / "config.json").is_file() and list(out.glob("*.safetensors"))
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    assert loaded.config.tie_word_embeddings
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
    for name, p in loaded.named_parameters():
        assert torch.equal(p.detach().reshape(-1), at20[name]), name
    reference = jobs.reference_model(jobs.run_config(), {f"fp32/{k}": v for k, v in at20.items()})
    assert torch.equal(_logits(loaded), _logits(reference))


def test_step_picks_the_composite_at_that_step(run):
    uri, at20, at15 = run
    store = LayerStore.open(uri)
    config = run_config_of(store)
    numel = layer_map_of(build_model(config.model)).numel
    model = composite_model(config, store, plan_export(store, numel, 15).records)
    assert all(torch.equal(p.detach().reshape(-1), at15[n]) for n, p in model.named_parameters())
    assert not torch.equal(
        dict(model.named_parameters())["model.embed_tokens.weight"].reshape(-1), at20["model.embed_tokens.weight"]
    )


def test_no_usable_version_at_the_step_names_the_run_and_step(run, tmp_path, capsys):
    uri, _, _ = run
    assert main(["export", uri, "--step", "5", "--format", "hf", "--out", str(tmp_path / "x")]) == 2
    message = capsys.readouterr().out
    assert uri in message and "step 5" in message and "embed" in message


def test_a_run_without_run_json_asks_for_config(run, tmp_path, capsys):
    uri, at20, _ = run
    config_file = tmp_path / "run-config.json"
    config_file.write_text((Path(uri) / RUN_CONFIG_FILE).read_text())
    (Path(uri) / RUN_CONFIG_FILE).unlink()
    assert main(["export", uri, "--format", "hf", "--out", str(tmp_path / "a")]) == 2
    message = capsys.readouterr().out
    assert uri in message and RUN_CONFIG_FILE in message and "--config" in message
    (Path(uri) / RUN_CONFIG_FILE).write_text('{"model": {"hf_config": {"model_type": "llama"}}, "steps": 0}')
    with pytest.raises(ExportError, match=f"{RUN_CONFIG_FILE} is not a valid run config .*steps"):
        export(uri, fmt="hf", out=tmp_path / "a")
    out = export(uri, fmt="hf", out=tmp_path / "b", config_path=config_file)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(out))
    assert torch.equal(loaded.model.embed_tokens.weight.reshape(-1), at20["model.embed_tokens.weight"])


def test_a_config_for_another_model_is_refused(run, tmp_path):
    other = jobs.run_config()
    other = dataclasses.replace(
        other, model=dataclasses.replace(other.model, hf_config=tiny_llama(tie_word_embeddings=True, hidden_size=32))
    )
    config_file = tmp_path / "other.json"
    config_file.write_text(json.dumps(other.to_json()))
    with pytest.raises(
        ExportError,
        match=r"does not fit the run config's model .*model.embed_tokens.weight: "
        r"stored \(256, 64\), model \(256, 32\)",
    ):
        export(run[0], fmt="deepspeed", out=tmp_path / "o", config_path=config_file)
    assert not (tmp_path / "o").exists()


def test_missing_run_and_occupied_out_dir_are_errors(run, tmp_path):
    with pytest.raises(ExportError, match="no committed layer versions"):
        export(str(tmp_path / "nothing"), fmt="hf", out=tmp_path / "o")
    occupied = tmp_path / "occupied"
    occupied.mkdir()
    (occupied / "keep.txt").write_text("mine")
    with pytest.raises(ExportError, match="not an empty directory"):
        export(run[0], fmt="hf", out=occupied)
    assert (occupied / "keep.txt").read_text() == "mine"


def test_world_size_is_for_deepspeed_only(run, tmp_path, capsys):
    assert main(["export", run[0], "--format", "hf", "--world-size", "2", "--out", str(tmp_path / "o")]) == 2
    assert "--world-size" in capsys.readouterr().out


def test_deepspeed_export_refuses_an_existing_tag(run, tmp_path, capsys):
    (tmp_path / "ds" / "step20").mkdir(parents=True)
    assert main(["export", run[0], "--format", "deepspeed", "--out", str(tmp_path / "ds")]) == 2
    assert "step20" in capsys.readouterr().out


def test_store_tools_leave_run_json_alone(run, capsys):
    """The driver's files in the store root (run.json, the drift trace) are neither orphans nor versions."""
    uri, _, _ = run
    store = LayerStore.open(uri)
    (Path(uri) / DRIFT_TRACE_FILE).write_text('{"layers": [], "steps": []}')
    root_files = {name: (Path(uri) / name).read_bytes() for name in (RUN_CONFIG_FILE, DRIFT_TRACE_FILE)}
    orphan = Path(uri) / "layers" / "embed" / "0000000099-rank00000of00001-0a0b0c0d.safetensors"  # its naming
    orphan.write_bytes(b"never committed")
    report = collect_garbage(store, GcConfig(grace_s=0.0))
    assert orphan.name in " ".join(report.orphans) and not orphan.exists()
    assert report.errors == () and not any(name in " ".join(report.orphans) for name in root_files)
    assert main(["gc", uri, "--grace", "0"]) == 0
    assert main(["verify", uri]) == 0
    assert main(["inspect", uri, "--json"]) == 0
    out = capsys.readouterr().out
    summary = json.loads(out[out.index("{") :])
    assert summary["newest_recoverable_step"] == 20
    assert {name: (Path(uri) / name).read_bytes() for name in root_files} == root_files


@pytest.mark.slow
def test_a_failing_export_rank_is_an_error_naming_the_version_and_stops_its_peer(run, tmp_path):
    """A shard that disappears after planning: the rank that reads it fails, its peer (waiting in
    a collective) is stopped, and the error names the version."""
    uri, _, _ = run
    store = LayerStore.open(uri)
    config = run_config_of(store)
    resolved = plan_export(store, layer_map_of(build_model(config.model)).numel, None)
    record = resolved.records["block.0"]
    (Path(uri) / record.shards[0].path).unlink()
    with pytest.raises(ExportError) as raised:
        export_deepspeed(config, store, resolved, tmp_path / "ds", 2, timeout_s=300)
    message = str(raised.value)
    assert "failed on rank" in message and record.version_id in message and "missing" in message
    assert "Traceback" not in message  # logged, not in the one-line error
    assert not (tmp_path / "ds" / "latest").exists()


def test_hf_export_takes_a_survivors_capture_over_the_whole_version(run, tmp_path):
    """A capture at 20 of rank 0's half of block.0 (whole at 10): the export's block.0 weights
    are the capture's where it holds them, the whole version's elsewhere."""
    uri, at20, _ = run
    store = LayerStore.open(uri, fsync=False)
    layer = layer_map_of(build_model(jobs.run_config().model))["block.0"]
    params = {p.name: p.shape for p in layer.params}
    gen = torch.Generator().manual_seed(7)
    state = {key: {n: torch.randn(math.prod(s), generator=gen) for n, s in params.items()} for key in STATE_KEYS}
    rank0 = cut_shards("block.0", 20, params, state, even_cuts(layer.numel, 2))[0]
    store.commit([store.write_shard(rank0, origin="capture")], partial=True)
    out = tmp_path / "hf"
    assert main(["export", uri, "--format", "hf", "--out", str(out)]) == 0
    loaded = dict(transformers.AutoModelForCausalLM.from_pretrained(str(out)).named_parameters())
    held = {s.name: (s.offset, s.offset + s.length) for s in rank0.slices}
    for name in params:
        expected = at20[name].clone()
        if name in held:
            lo, hi = held[name]
            expected[lo:hi] = state["fp32"][name][lo:hi]
        assert torch.equal(loaded[name].detach().reshape(-1), expected), name
    assert held and sum(hi - lo for lo, hi in held.values()) < layer.numel


def test_a_layer_never_saved_exports_as_the_runs_initial_state(tmp_path):
    """A run that recorded its initial state (``initial.json``: ``layercheck train`` rebuilds it
    from run.json) exports a layer it never saved with the weights that build gives."""
    from layercheck.orchestrator.store.initial_state import record_initial

    uri = str(tmp_path / "run")
    store = LayerStore.open(uri, fsync=False)
    jobs.write_run_json(uri, jobs.run_config())
    built = build_model(jobs.run_config().model)
    layer_map = layer_map_of(built)
    record_initial(store.fs, layer_map.names)
    saved = {}
    for i, layer in enumerate(layer_map.layers[:-1]):  # every layer but the last
        saved.update(_write_layer(store, layer, 10, base=True, seed=i))
    out = tmp_path / "hf"
    assert main(["export", uri, "--format", "hf", "--out", str(out)]) == 0
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(out))
    initial = dict(built.named_parameters())
    for name, p in loaded.named_parameters():
        want = saved[name] if name in saved else initial[name].detach().reshape(-1)
        assert torch.equal(p.detach().reshape(-1), want), name
    assert any(name not in saved for name, _ in loaded.named_parameters())


def test_an_own_loops_run_exports_from_its_model_record(tmp_path, caplog, capsys):
    """A LayerCheckTrainer run has no run.json: its driver recorded model.json (the transformers
    config it planned the layers from, and the tokenizer if named). HF export needs nothing else and
    says plainly that no tokenizer was named; a DeepSpeed or DCP export is refused with what to do."""
    import logging

    from layercheck.orchestrator.store.model_record import describe_model, write_model_record

    uri = str(tmp_path / "run")
    store = LayerStore.open(uri, fsync=False)
    config = transformers.LlamaConfig(
        **{k: v for k, v in jobs.run_config().model.hf_config.items() if k != "model_type"}
    )
    write_model_record(store.fs, describe_model(config))
    layer_map = layer_map_of(build_model(jobs.run_config().model))
    weights = {}
    for i, layer in enumerate(layer_map.layers):
        weights.update(_write_layer(store, layer, 10, base=True, seed=i))
    out = tmp_path / "hf"
    with caplog.at_level(logging.WARNING):
        assert main(["export", uri, "--format", "hf", "--out", str(out)]) == 0
    assert "named no tokenizer" in caplog.text
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(out))
    for name, p in loaded.named_parameters():
        assert torch.equal(p.detach().reshape(-1), weights[name]), name
    assert main(["export", uri, "--format", "deepspeed", "--out", str(tmp_path / "ds")]) == 2
    assert "is an own loop's" in capsys.readouterr().out
    # a DCP checkpoint carries param groups, which dcp.load puts in the user's optimizer: not made up
    assert main(["export", uri, "--format", "dcp", "--out", str(tmp_path / "dcp")]) == 2
    assert "is an own loop's" in (out := capsys.readouterr().out) and "--config" in out


def test_a_damaged_model_record_is_named(tmp_path, capsys):
    uri = str(tmp_path / "run")
    store = LayerStore.open(uri, fsync=False)
    layer = layer_map_of(build_model(jobs.run_config().model)).layers[0]
    _write_layer(store, layer, 10, base=True, seed=0)
    store.fs.write_bytes("model.json", b'{"format": "layercheck.model/1", "hf_config": {}}')
    assert main(["export", uri, "--format", "hf", "--out", str(tmp_path / "hf")]) == 2
    out = capsys.readouterr().out
    assert "model.json: not a valid model record" in out and "--config" in out


def test_an_export_of_a_store_a_live_run_writes_is_the_composite_at_the_newest_step_it_planned(tmp_path, monkeypatch):
    """``layercheck export`` of a store a live run is writing: the run holds the store's lease and
    a thread of it commits a version of every layer at every step, while the export plans and,
    once it has planned, two steps past the plan's before the export reads a byte. The model written
    is the composite at the newest recoverable step the plan saw, byte for byte: each layer's
    version at or before that step and no older than its newest committed before the plan;
    nothing committed since leaks in, and the export is not refused for the live owner."""
    import threading

    import layercheck.orchestrator.offline.exporter as exporter
    from layercheck.orchestrator.store.fs import StoreFS
    from layercheck.orchestrator.store.lease import StoreLease

    uri = str(tmp_path / "run")
    config = dataclasses.replace(jobs.run_config(), steps=1_000_000)
    lease = StoreLease.acquire(StoreFS.open(uri, fsync=False), run="live", settle_s=0, steps=config.steps)
    store = LayerStore(lease.fs)
    store.fence = lease.fence
    jobs.write_run_json(uri, config)
    layers = layer_map_of(build_model(config.model)).layers
    weights = {(layer.name, 10): _write_layer(store, layer, 10, base=True, seed=i) for i, layer in enumerate(layers)}
    newest = dict.fromkeys((layer.name for layer in layers), 10)  # each layer's newest committed step
    committed = threading.Condition()
    until = [12]  # the run trains up to this step, then waits (the test paces it, not a clock)
    stop = threading.Event()

    def train() -> None:  # the live run: every layer committed at every step
        while True:
            with committed:
                committed.wait_for(lambda: stop.is_set() or min(newest.values()) < until[0])
            if stop.is_set():
                return
            step = min(newest.values()) + 1
            for i, layer in enumerate(layers):
                weights[(layer.name, step)] = _write_layer(store, layer, step, base=False, seed=1000 * step + i)
                with committed:
                    newest[layer.name] = step
                    committed.notify_all()

    plans = []

    def plan_then_let_the_run_go_on(*args, **kwargs):
        with committed:
            before = dict(newest)
            until[0] = max(before.values()) + 1  # one more step may land while the export plans
            committed.notify_all()
        resolved = plan_export(*args, **kwargs)
        plans.append((before, resolved))
        with committed:  # and commits every layer two steps past the plan before the export reads
            until[0] = max(resolved.plan.t_fail + 2, max(newest.values()))
            committed.notify_all()
            assert committed.wait_for(lambda: min(newest.values()) >= resolved.plan.t_fail + 2, timeout=60)
        return resolved

    monkeypatch.setattr(exporter, "plan_export", plan_then_let_the_run_go_on)
    writer = threading.Thread(target=train, daemon=True)
    writer.start()
    with committed:
        committed.wait_for(lambda: min(newest.values()) >= 12, timeout=60)
    out = tmp_path / "hf"
    try:
        assert main(["export", uri, "--format", "hf", "--out", str(out)]) == 0
    finally:
        with committed:
            stop.set()
            committed.notify_all()
        writer.join(timeout=60)
        lease.release()
    ((before, resolved),) = plans
    step = resolved.plan.t_fail
    assert step >= max(before.values()) and min(newest.values()) >= step + 2
    loaded = dict(transformers.AutoModelForCausalLM.from_pretrained(str(out)).named_parameters())
    for layer in layers:
        chosen = resolved.records[layer.name].step
        assert before[layer.name] <= chosen <= step, (layer.name, before[layer.name], chosen, step)
        for param, expected in weights[(layer.name, chosen)].items():
            assert torch.equal(loaded[param].detach().reshape(-1), expected), (layer.name, chosen, param)
