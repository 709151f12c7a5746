"""Telling two models apart by the config fields that shape their state, not by parameter counts
(``orchestrator/store/model_identity.py``): the built-in loop's ``--resume`` (tests/orchestrator/core/test_run_start.py)
and an own loop's ``attach`` (here) compare the same fields."""

import pytest
import torch
import transformers

from layercheck.config import CheckpointConfig
from layercheck.orchestrator.store.fs import StoreFS
from layercheck.orchestrator.store.model_identity import (
    identity_changes,
    model_identity,
    recorded_identity,
    recorded_model_changes,
)
from layercheck.orchestrator.store.model_record import describe_model
from layercheck.policies.layer_map import layer_map_of
from layercheck.trainer import LayerCheckTrainer
from tests.support import attach_jobs
from tests.support.dist_harness import run_ranks
from tests.support.models import TINY_LLAMA, tiny_llama


def _config(**fields):
    hf = dict(fields)
    return transformers.AutoConfig.for_model(hf.pop("model_type"), **hf)


def _meta_model(config):
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config)


def test_the_identity_is_what_the_config_reports_defaults_included():
    identity = model_identity(_config(**TINY_LLAMA))
    assert identity == {
        "model_type": "llama",
        "num_hidden_layers": 2,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,  # not in the dict: hidden_size // num_attention_heads
        "vocab_size": 256,
        "tie_word_embeddings": False,
    }
    gpt2 = model_identity(transformers.GPT2Config(n_embd=64, n_head=4, n_layer=2))
    assert gpt2["num_attention_heads"] == 4 and gpt2["hidden_size"] == 64  # through GPT-2's attribute_map
    assert "head_dim" not in gpt2 and "num_key_value_heads" not in gpt2  # fields its class lacks


def test_heads_that_keep_every_shape_are_told_apart():
    four, eight = _config(**TINY_LLAMA), _config(**tiny_llama(num_attention_heads=8, num_key_value_heads=4))
    assert layer_map_of(_meta_model(four)).numel == layer_map_of(_meta_model(eight)).numel  # counts agree
    assert identity_changes(model_identity(four), model_identity(eight)) == [
        "num_attention_heads: 4 -> 8",
        "num_key_value_heads: 2 -> 4",
        "head_dim: 16 -> 8",
    ]
    assert identity_changes(model_identity(four), model_identity(_config(**TINY_LLAMA))) == []


def test_a_field_only_one_side_has_is_not_compared():
    stored = {"model_type": "llama", "num_attention_heads": 4}  # an older record: no head_dim
    assert identity_changes(stored, {**stored, "head_dim": 16}) == []
    assert identity_changes(stored, {"num_attention_heads": 8}) == ["num_attention_heads: 4 -> 8"]


def test_a_recorded_dict_counts_the_defaults_it_left_out():
    """``model.json`` holds ``to_diff_dict()``: without ``num_key_value_heads`` a Llama config has as
    many kv heads as heads, and a record from before ``head_dim`` existed gets hidden/heads."""
    record = {k: v for k, v in TINY_LLAMA.items() if k != "num_key_value_heads"}
    assert recorded_identity(record)["num_key_value_heads"] == 4
    assert identity_changes(recorded_identity(record), model_identity(_config(**TINY_LLAMA))) == [
        "num_key_value_heads: 4 -> 2"
    ]
    assert recorded_identity(describe_model(_config(**TINY_LLAMA)).hf_config) == model_identity(_config(**TINY_LLAMA))
    # a model type this transformers does not know: the fields the record holds, no others
    assert recorded_identity({"model_type": "not-a-model", "hidden_size": 64, "rope_theta": 1.0}) == {
        "model_type": "not-a-model",
        "hidden_size": 64,
    }


def _own_loop_store(tmp_path, model):
    """What the driver of an own loop records: ``LayerCheckTrainer``'s own ``model.json`` writer."""
    trainer = LayerCheckTrainer(
        lambda: None, model=model, checkpoint=CheckpointConfig(storage=str(tmp_path / "run")), scaling_config=None
    )
    fs = StoreFS.open(str(tmp_path / "run"))
    trainer._record_model(fs)
    return fs


def test_an_own_loops_model_json_tells_the_model_apart(tmp_path):
    fs = _own_loop_store(tmp_path, _config(**TINY_LLAMA))
    eight = _meta_model(_config(**tiny_llama(num_attention_heads=8, num_key_value_heads=4)))
    assert recorded_model_changes(fs, eight) == [
        "num_attention_heads: 4 -> 8",
        "num_key_value_heads: 2 -> 4",
        "head_dim: 16 -> 8",
    ]
    assert recorded_model_changes(fs, _meta_model(_config(**TINY_LLAMA))) == []
    assert recorded_model_changes(fs, torch.nn.Linear(2, 2)) == []  # no config to compare
    assert recorded_model_changes(StoreFS.open(str(tmp_path / "none")), eight) == []  # no record


@pytest.mark.slow
def test_attach_refuses_a_model_other_than_the_recorded_one_before_anything_is_written(tmp_path):
    """A real DeepSpeed engine of 8/4 heads (every layer the size the trainer planned) attached to a
    run whose driver recorded 4/2 heads: ``attach`` raises before it joins the run (no Ray here,
    nothing written)."""
    fs = _own_loop_store(tmp_path, _config(**TINY_LLAMA))
    files = sorted(p.name for p in (tmp_path / "run").rglob("*"))
    (result,) = run_ranks(attach_jobs.recorded_model_job, 1, str(tmp_path / "run"), 8, 4)
    assert result.startswith("LayerMismatchError"), result
    assert "num_attention_heads: 4 -> 8, num_key_value_heads: 2 -> 4, head_dim: 16 -> 8" in result
    assert sorted(p.name for p in (tmp_path / "run").rglob("*")) == files
    assert recorded_model_changes(fs, _meta_model(_config(**TINY_LLAMA))) == []  # model.json as recorded
