"""model.freeze patterns and layer-wise LR decay factors (no DeepSpeed)."""

from __future__ import annotations

import pytest

from layercheck.policies.config_loader import ConfigError, from_mapping
from layercheck.policies.layer_map import layer_map_of
from layercheck.workers.config import ModelConfig, OptimConfig
from layercheck.workers.engine import build_model, layer_map_for, param_groups
from layercheck.workers.freeze import lr_scale
from tests.support.models import FOUR_BLOCKS


def test_freeze_keeps_the_other_blocks_numbers():
    model = build_model(ModelConfig(hf_config=FOUR_BLOCKS, freeze=("block.[02]", "embed")))
    assert layer_map_of(model).names == ("block.1", "block.3", "norm", "lm_head")
    assert all(not p.requires_grad for n, p in model.named_parameters() if ".layers.0." in n or "embed" in n)
    assert layer_map_for(ModelConfig(hf_config=FOUR_BLOCKS, freeze=("block.[02]", "embed"))) == layer_map_of(model)


def test_freeze_refuses_a_pattern_matching_nothing_and_freezing_everything():
    with pytest.raises(ConfigError, match=r"model.freeze: 'blocks.\*' matches no layer"):
        build_model(ModelConfig(hf_config=FOUR_BLOCKS, freeze=("blocks.*",)))
    with pytest.raises(ConfigError, match="freezes every layer"):
        build_model(ModelConfig(hf_config=FOUR_BLOCKS, freeze=("*",)))


def test_freeze_and_decay_fields_are_validated_and_load_from_toml_lists():
    cfg = from_mapping(ModelConfig, {"hf_config": FOUR_BLOCKS, "freeze": ["embed", "block.0"]})
    assert cfg.freeze == ("embed", "block.0")
    with pytest.raises(ConfigError, match="freeze"):
        ModelConfig(hf_config=FOUR_BLOCKS, freeze=("",))
    for bad in (0.0, 1.5, -0.1):
        with pytest.raises(ConfigError, match="layer_lr_decay"):
            OptimConfig(layer_lr_decay=bad)


def test_lr_scale_embed_lowest_last_block_and_head_full():
    b = 4
    assert [lr_scale(f"block.{i}", b, 0.8) for i in range(b)] == pytest.approx([0.8**3, 0.8**2, 0.8, 1.0])
    assert lr_scale("embed", b, 0.8) == pytest.approx(0.8**4)
    assert lr_scale("norm", b, 0.8) == lr_scale("lm_head", b, 0.8) == 1.0
    assert lr_scale("block.0", b, 1.0) == 1.0


def test_param_groups_carry_the_decayed_lr_counting_frozen_blocks():
    model = build_model(ModelConfig(hf_config=FOUR_BLOCKS, freeze=("block.3",)))
    groups = param_groups(model, layer_map_of(model), OptimConfig(lr=1.0, layer_lr_decay=0.5))
    lrs = {g["name"]: g["lr"] for g in groups}
    assert lrs["block.0/decay"] == pytest.approx(0.125) and lrs["block.2/decay"] == pytest.approx(0.5)
    assert lrs["embed/decay"] == pytest.approx(0.0625) and lrs["lm_head/decay"] == 1.0
    assert not any(name.startswith("block.3/") for name in lrs)
