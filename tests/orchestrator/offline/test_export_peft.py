"""``layercheck export`` of a run that trained a ``peft`` LoRA adapter (its layers hold the adapter
alone; the base weights are not in the store): the adapter in peft's own format, which
``PeftModel.from_pretrained`` loads onto the base, and with ``--merge`` the base model with the
adapter merged in. The store is written in-process (no DeepSpeed), as a LayerCheckTrainer run's."""

from __future__ import annotations

import math

import peft
import pytest
import torch
import transformers

from layercheck.orchestrator.cli.main import main
from layercheck.orchestrator.store.layer_store import LayerStore
from layercheck.orchestrator.store.model_record import describe_model, write_model_record
from layercheck.policies.layer_map import layer_map_of
from layercheck.workers.config import ModelConfig
from layercheck.workers.engine import build_model
from layercheck.workers.shard import STATE_KEYS
from tests.support.models import TINY_LLAMA
from tests.support.store_helpers import cut_shards, even_cuts

LORA = {"r": 2, "lora_alpha": 4, "target_modules": ["q_proj", "v_proj"]}


@pytest.fixture
def adapter_run(tmp_path):
    """(store uri, base model dir, the adapter's stored fp32 weights by parameter name)."""
    base_dir = tmp_path / "base"
    build_model(ModelConfig(hf_config=TINY_LLAMA)).save_pretrained(str(base_dir))
    base = transformers.AutoModelForCausalLM.from_pretrained(str(base_dir))
    model = peft.get_peft_model(base, peft.LoraConfig(**LORA))
    layer_map = layer_map_of(model)
    assert all(name.startswith("block.") for name in layer_map.names)  # the adapter's layers only
    uri = str(tmp_path / "run")
    store = LayerStore.open(uri, fsync=False)
    write_model_record(store.fs, describe_model(model))
    stored = {}
    gen = torch.Generator().manual_seed(0)
    for layer in layer_map.layers:
        params = {p.name: p.shape for p in layer.params}
        state = {key: {n: torch.randn(math.prod(s), generator=gen) for n, s in params.items()} for key in STATE_KEYS}
        store.write_version(cut_shards(layer.name, 7, params, state, even_cuts(layer.numel, 2)), base=True)
        stored.update(state["fp32"])
    return uri, base_dir, stored


def test_the_adapter_exports_in_peft_format_and_loads_onto_its_base(adapter_run, tmp_path):
    uri, base_dir, stored = adapter_run
    out = tmp_path / "adapter"
    assert main(["export", uri, "--format", "hf", "--out", str(out)]) == 0
    assert (out / "adapter_config.json").is_file() and (out / "adapter_model.safetensors").is_file()
    base = transformers.AutoModelForCausalLM.from_pretrained(str(base_dir))
    loaded = peft.PeftModel.from_pretrained(base, str(out))
    lora = {n: p for n, p in loaded.named_parameters() if "lora_" in n}
    assert lora and set(lora) == set(stored)
    for name, param in lora.items():
        assert torch.equal(param.detach().reshape(-1), stored[name]), name


def test_merge_writes_the_base_with_the_adapter_merged_in(adapter_run, tmp_path):
    uri, base_dir, _ = adapter_run
    adapter, merged = tmp_path / "adapter", tmp_path / "merged"
    assert main(["export", uri, "--format", "hf", "--out", str(adapter)]) == 0
    assert main(["export", uri, "--format", "hf", "--merge", "--out", str(merged)]) == 0
    expected = peft.PeftModel.from_pretrained(
        transformers.AutoModelForCausalLM.from_pretrained(str(base_dir)), str(adapter)
    ).merge_and_unload()
    got = transformers.AutoModelForCausalLM.from_pretrained(str(merged))
    want = dict(expected.named_parameters())
    for name, param in got.named_parameters():
        torch.testing.assert_close(param, want[name], rtol=0, atol=1e-6, msg=name)
    q = "model.layers.0.self_attn.q_proj.weight"
    base = dict(transformers.AutoModelForCausalLM.from_pretrained(str(base_dir)).named_parameters())
    assert not torch.equal(dict(got.named_parameters())[q], base[q]), "the adapter must change what it targets"


def test_an_adapter_run_is_refused_where_it_cannot_be_exported(adapter_run, tmp_path, capsys):
    uri, _, _ = adapter_run
    assert main(["export", uri, "--format", "deepspeed", "--out", str(tmp_path / "ds")]) == 2
    assert "trained a peft adapter: export it with --format hf" in capsys.readouterr().out
