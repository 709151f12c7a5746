"""Worker configuration, the learning-rate schedule and layer-aligned param groups (no DeepSpeed)."""

from __future__ import annotations

import dataclasses

import pytest
import transformers
from hypothesis import given
from hypothesis import strategies as st

from layercheck.policies.layer_map import layer_map_of
from layercheck.workers.config import EngineConfig, ModelConfig, OptimConfig
from layercheck.workers.engine import build_model, param_groups
from layercheck.workers.engines.deepspeed import deepspeed_config
from layercheck.workers.lr_schedule import lr_at, lr_factor
from tests.support.models import TINY_LLAMA


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"lr": 0.0}, "^lr: must"),
        ({"betas": (0.9, 1.0)}, "^betas: must"),
        ({"warmup_steps": 10, "total_steps": 5}, "^total_steps: must"),
        ({"min_lr_ratio": 1.5}, "^min_lr_ratio: must"),
        ({"schedule": "step"}, "^schedule: must"),
        ({"weight_decay": -1.0}, "^weight_decay: must"),
    ],
)
def test_optim_config_names_the_bad_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        OptimConfig(**kwargs)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"zero_stage": 4}, "^zero_stage: must"),
        ({"precision": "fp16"}, "^precision: must"),
        ({"micro_batch": 0}, "^micro_batch: must"),
        ({"grad_accum": 0}, "^grad_accum: must"),
        ({"grad_clip": -1.0}, "^grad_clip: must"),
    ],
)
def test_engine_config_names_the_bad_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        EngineConfig(**kwargs)


def test_model_config_needs_exactly_one_source():
    with pytest.raises(ValueError, match="exactly one"):
        ModelConfig()
    with pytest.raises(ValueError, match="exactly one"):
        ModelConfig(hf_config=TINY_LLAMA, path="/x")
    with pytest.raises(ValueError, match="model_type"):
        ModelConfig(hf_config={"hidden_size": 8})


def test_configs_are_frozen_and_keyword_only():
    cfg = OptimConfig(lr=1e-4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.lr = 1.0  # type: ignore[misc]
    with pytest.raises(TypeError):
        OptimConfig(1e-4)  # type: ignore[misc]


def test_schedule_shapes():
    cos = OptimConfig(lr=1.0, warmup_steps=4, total_steps=14, min_lr_ratio=0.1, schedule="cosine")
    assert [lr_at(s, cos) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_at(4, cos) == pytest.approx(1.0)
    assert lr_at(9, cos) == pytest.approx(0.55)  # half way: 0.1 + 0.9 * 0.5
    assert lr_at(14, cos) == pytest.approx(0.1) and lr_at(1000, cos) == pytest.approx(0.1)
    lin = OptimConfig(lr=2.0, warmup_steps=0, total_steps=10, min_lr_ratio=0.0, schedule="linear")
    assert [lr_at(s, lin) for s in (0, 5, 10)] == pytest.approx([2.0, 1.0, 0.0])
    const = OptimConfig(lr=3.0, warmup_steps=2, total_steps=10, schedule="constant")
    assert [lr_at(s, const) for s in (0, 1, 2, 50)] == [1.5, 3.0, 3.0, 3.0]


@given(
    st.integers(0, 50),
    st.integers(0, 200),
    st.integers(0, 500),
    st.floats(0, 1),
    st.sampled_from(["cosine", "linear", "constant"]),
)
def test_schedule_stays_within_bounds(warmup, extra, step, floor, schedule):
    cfg = OptimConfig(lr=1.0, warmup_steps=warmup, total_steps=warmup + extra, min_lr_ratio=floor, schedule=schedule)
    factor = lr_factor(step, cfg)
    assert 0.0 <= factor <= 1.0 + 1e-12
    if step < cfg.total_steps or floor > 0 or schedule == "constant":
        assert factor > 0.0  # zero only once a decay to a zero floor has ended
    if step >= warmup and schedule != "constant":
        assert factor >= floor - 1e-12


def test_param_groups_mirror_the_layer_map():
    model = build_model(ModelConfig(hf_config=TINY_LLAMA, seed=1))
    layer_map = layer_map_of(model)
    cfg = OptimConfig(lr=1e-4, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.05)
    groups = param_groups(model, layer_map, cfg)
    by_name = {g["name"]: g for g in groups}
    assert list(by_name) == [
        "embed/decay",
        "block.0/decay",
        "block.0/no_decay",
        "block.1/decay",
        "block.1/no_decay",
        "norm/no_decay",
        "lm_head/decay",
    ]
    params = dict(model.named_parameters())
    for layer in layer_map.layers:
        for kind, infos in (("decay", layer.decay_params), ("no_decay", layer.no_decay_params)):
            if not infos:
                assert f"{layer.name}/{kind}" not in by_name
                continue
            group = by_name[f"{layer.name}/{kind}"]
            assert [id(p) for p in group["params"]] == [id(params[i.name]) for i in infos]
            assert group["layer"] == layer.name
            assert group["weight_decay"] == (0.05 if kind == "decay" else 0.0)
            assert (group["lr"], group["betas"], group["eps"]) == (1e-4, (0.8, 0.95), 1e-6)
    assert sum(len(g["params"]) for g in groups) == len(params)


def test_same_seed_same_weights_and_local_path(tmp_path):
    a = build_model(ModelConfig(hf_config=TINY_LLAMA, seed=3))
    b = build_model(ModelConfig(hf_config=TINY_LLAMA, seed=3))
    assert all((pa == pb).all() for pa, pb in zip(a.parameters(), b.parameters()))
    a.save_pretrained(tmp_path)
    c = build_model(ModelConfig(path=str(tmp_path)))
    assert isinstance(c, transformers.PreTrainedModel)
    assert all((pa == pc).all() for pa, pc in zip(a.parameters(), c.parameters()))


def test_deepspeed_config():
    ds = deepspeed_config(
        EngineConfig(
            zero_stage=3,
            precision="bf16",
            micro_batch=4,
            grad_accum=2,
            grad_clip=1.0,
            extra_ds_config={"zero_optimization": {"sub_group_size": 1000}},
        )
    )
    assert ds["zero_optimization"] == {"stage": 3, "sub_group_size": 1000}
    assert ds["bf16"] == {"enabled": True}
    assert (ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"], ds["gradient_clipping"]) == (
        4,
        2,
        1.0,
    )
    assert ds["zero_allow_untested_optimizer"] is True


@pytest.mark.parametrize(
    "extra, field",
    [
        ({"zero_optimization": {"stage": 2}}, "zero_optimization.stage: 2 contradicts zero_stage"),
        ({"train_micro_batch_size_per_gpu": 8}, "train_micro_batch_size_per_gpu: 8 contradicts micro_batch"),
        ({"bf16": {"enabled": True}}, "bf16.enabled: True contradicts precision"),
    ],
)
def test_extra_ds_config_may_not_contradict_the_modelled_fields(extra, field):
    from layercheck.policies.config_loader import ConfigError

    with pytest.raises(ConfigError, match=f"extra_ds_config.{field}"):
        EngineConfig(zero_stage=3, micro_batch=4, extra_ds_config=extra)
    EngineConfig(zero_stage=3, micro_batch=4, extra_ds_config={"zero_optimization": {"stage": 3}})  # agreeing: fine
