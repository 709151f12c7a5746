"""LayerCheckCallback keeps the ``Trainer``'s tokenizer (its ``processing_class``: here the bundled
SFT tokenizer, a real one with a chat template) in the run's store where the run named none, and
``layercheck export --format hf`` of that store ships it: the real callback and the real export,
without Ray or DeepSpeed (the engine's attachment is scripted; the layer versions are written
straight into the store, as ``tests/orchestrator/offline/test_export.py`` writes them)."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import transformers

from layercheck.hf import LayerCheckCallback
from layercheck.orchestrator.cli.main import main
from layercheck.orchestrator.core.run_config import FaultConfig
from layercheck.orchestrator.runtime import context
from layercheck.orchestrator.store.fs import StoreFS
from layercheck.orchestrator.store.layer_store import LayerStore
from layercheck.orchestrator.store.model_record import describe_model, read_model_record, write_model_record
from layercheck.orchestrator.store.run_dir import clear_run, run_dir_contents
from layercheck.policies.layer_map import layer_map_of
from layercheck.workers.config import ModelConfig
from layercheck.workers.engine import build_model
from layercheck.workers.shard import STATE_KEYS
from tests.support.models import SFT_LLAMA
from tests.support.store_helpers import cut_shards, even_cuts

SFT_TOKENIZER = Path(__file__).resolve().parents[2] / "examples" / "data" / "sft-tokenizer"


class TinyLM(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Linear(2, 2)


@pytest.fixture
def trainer_run(tmp_path, monkeypatch):
    """A run's store as a ``LayerCheckTrainer`` driver leaves it (``model.json``: the model, no
    tokenizer named), current in this worker, and a real ``Trainer`` whose tokenizer is the SFT one."""
    pytest.importorskip("accelerate", reason="the Trainer needs accelerate (the test extra)")
    uri = str(tmp_path / "run")
    fs = StoreFS.open(uri, fsync=False)
    config = transformers.LlamaConfig(**{k: v for k, v in SFT_LLAMA.items() if k != "model_type"})
    write_model_record(fs, describe_model(config))
    ctx = context.WorkerContext(
        run_id="tokenizer-test",
        storage_uri=uri,
        fsync=False,
        max_inflight_bytes=1 << 20,
        fault=FaultConfig(),
        drift_probe="auto",
        layer_map=None,
        layer_numel={},
    )
    monkeypatch.setattr(context, "_current", ctx)
    monkeypatch.setattr("layercheck.hf.require_supported_engine", lambda trainer: None)  # the engine is scripted away
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(SFT_TOKENIZER), local_files_only=True)
    args = transformers.TrainingArguments(output_dir=str(tmp_path / "out"), use_cpu=True, report_to=[])
    trainer = transformers.Trainer(model=TinyLM(), args=args, processing_class=tokenizer)
    return uri, fs, trainer


def _begin(trainer) -> None:
    """The callback's ``on_train_begin`` on a worker group's first start (attach scripted)."""
    callback = LayerCheckCallback(trainer, attach=lambda t: SimpleNamespace(start_step=1))
    callback.on_train_begin(trainer.args, transformers.TrainerState(), None)


def _write_versions(uri: str) -> None:
    """Every layer of the recorded model at step 10 (random states, two ranks)."""
    store = LayerStore.open(uri, fsync=False)
    for i, layer in enumerate(layer_map_of(build_model(ModelConfig(hf_config=SFT_LLAMA))).layers):
        params = {p.name: p.shape for p in layer.params}
        gen = torch.Generator().manual_seed(i)
        state = {k: {n: torch.randn(math.prod(s), generator=gen) for n, s in params.items()} for k in STATE_KEYS}
        store.write_version(cut_shards(layer.name, 10, params, state, even_cuts(layer.numel, 2)), base=True)


def test_the_trainers_tokenizer_is_kept_and_the_export_ships_it(trainer_run, tmp_path, caplog):
    uri, fs, trainer = trainer_run
    _begin(trainer)
    record = read_model_record(fs)
    assert record is not None and record.tokenizer is None and "tokenizer.json" in record.tokenizer_files
    stored = transformers.AutoTokenizer.from_pretrained(str(Path(uri) / "tokenizer"), local_files_only=True)
    assert stored.chat_template == trainer.processing_class.chat_template
    assert run_dir_contents(fs).foreign == ()  # LayerCheck's own files: --overwrite and gc know them

    _write_versions(uri)
    out = tmp_path / "hf"
    with caplog.at_level(logging.INFO):
        assert main(["export", uri, "--format", "hf", "--out", str(out)]) == 0
    exported = transformers.AutoTokenizer.from_pretrained(str(out))
    assert exported.chat_template == trainer.processing_class.chat_template
    sample = "<|user|>hello, LayerCheck<|end|>"
    assert exported(sample)["input_ids"] == trainer.processing_class(sample)["input_ids"]
    assert "data.tokenizer" not in caplog.text and "byte tokens" not in caplog.text


def test_a_tokenizer_kept_once_is_not_written_again_and_a_named_one_is_not_kept(trainer_run):
    uri, fs, trainer = trainer_run
    _begin(trainer)
    written = {p.name: p.stat().st_mtime_ns for p in (Path(uri) / "tokenizer").iterdir()}
    _begin(trainer)  # a restarted worker group's callback
    assert {p.name: p.stat().st_mtime_ns for p in (Path(uri) / "tokenizer").iterdir()} == written

    assert clear_run(fs) > len(written)  # --overwrite deletes them with the run's other files
    assert not (Path(uri) / "tokenizer").exists()
    named = dataclasses.replace(describe_model(transformers.LlamaConfig()), tokenizer=str(SFT_TOKENIZER))
    write_model_record(fs, named)
    _begin(trainer)
    assert not (Path(uri) / "tokenizer").exists()
    assert json.loads((Path(uri) / "model.json").read_text())["tokenizer_files"] == []


def test_an_export_without_a_tokenizer_says_so_without_the_built_in_loops_data(trainer_run, tmp_path, caplog):
    uri, _, _ = trainer_run  # the callback never ran: no tokenizer kept, none named
    _write_versions(uri)
    with caplog.at_level(logging.INFO):
        assert main(["export", uri, "--format", "hf", "--out", str(tmp_path / "hf")]) == 0
    assert "named no tokenizer" in caplog.text and "kept none" in caplog.text
    assert "data.tokenizer" not in caplog.text and "byte tokens" not in caplog.text
