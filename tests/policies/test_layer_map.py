import pytest
import torch

from layercheck.policies.layer_map import LayerMap, UnplacedParameterError, build_layer_map, layer_map_of
from tests.support.models import tiny_model

FAMILIES = ["llama", "mistral", "qwen2", "gpt2", "gpt_neox", "opt", "falcon", "phi"]


@pytest.mark.parametrize("family", FAMILIES)
def test_layers_are_embed_blocks_norm_head_in_model_order(family):
    model = tiny_model(family)
    layer_map = layer_map_of(model)
    tied = model.config.tie_word_embeddings
    expected = ["embed", "block.0", "block.1", "norm"] + ([] if tied else ["lm_head"])
    assert list(layer_map.names) == expected
    # every trainable parameter lands in exactly one layer, with its element count
    params = dict(model.named_parameters())
    placed = [p.name for layer in layer_map.layers for p in layer.params]
    assert sorted(placed) == sorted(params)
    assert layer_map.total_numel == sum(p.numel() for p in params.values())
    for layer in layer_map.layers:
        for info in layer.params:
            assert info.numel == params[info.name].numel()
            assert info.shape == tuple(params[info.name].shape)


@pytest.mark.parametrize("family", ["qwen2", "gpt2"])
def test_tied_lm_head_is_not_a_separate_layer(family):
    model = tiny_model(family, tie_word_embeddings=True)
    assert model.lm_head.weight is model.get_input_embeddings().weight
    assert "lm_head" not in layer_map_of(model).names


def test_untied_lm_head_is_its_own_layer():
    layer_map = layer_map_of(tiny_model("llama", tie_word_embeddings=False))
    assert layer_map["lm_head"].params[0].name == "lm_head.weight"


@pytest.mark.parametrize("family", FAMILIES)
def test_weight_decay_split_excludes_biases_and_norms(family):
    layer_map = layer_map_of(tiny_model(family))
    for layer in layer_map.layers:
        for info in layer.params:
            is_norm = "norm" in info.name or ".ln_" in info.name or "ln_f" in info.name
            if info.name.endswith("bias") or is_norm or len(info.shape) < 2:
                assert not info.decay, info.name
            else:
                assert info.decay, info.name
    block = layer_map["block.0"]
    assert block.decay_params and block.no_decay_params


def test_gpt2_position_embedding_belongs_to_embed():
    layer_map = layer_map_of(tiny_model("gpt2"))
    assert [p.name for p in layer_map["embed"].params] == ["transformer.wte.weight", "transformer.wpe.weight"]


def test_unknown_module_is_named_in_the_error():
    with pytest.raises(UnplacedParameterError, match="vision_tower.proj.weight"):
        build_layer_map([("model.layers.0.q.weight", (4, 4)), ("vision_tower.proj.weight", (4, 4))])


def test_model_without_blocks_is_refused():
    with pytest.raises(UnplacedParameterError, match="no numbered transformer blocks"):
        build_layer_map([("model.embed_tokens.weight", (4, 4))])


def test_frozen_parameters_are_not_tracked():
    model = tiny_model("llama")
    model.model.embed_tokens.weight.requires_grad_(False)
    assert "embed" not in layer_map_of(model).names


def test_json_round_trip_and_lookup():
    layer_map = layer_map_of(tiny_model("llama"))
    again = LayerMap.from_json(layer_map.to_json())
    assert again == layer_map
    assert again.layer_of("model.layers.1.mlp.up_proj.weight") == "block.1"
    with pytest.raises(KeyError):
        again.layer_of("nope")
    assert isinstance(torch.Size(layer_map["norm"].params[0].shape), torch.Size)


def test_an_untied_head_is_placed_under_a_wrappers_prefix():
    """peft wraps the model as ``base_model.model.…``: an untied ``lm_head`` is still the head
    (a LoRA run of such a model once failed to start: its frozen head was 'unplaced')."""
    names = [
        ("base_model.model.model.embed_tokens.weight", (8, 4)),
        ("base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight", (2, 4)),
        ("base_model.model.model.norm.weight", (4,)),
        ("base_model.model.lm_head.weight", (8, 4)),
    ]
    layer_map = build_layer_map(names)
    assert layer_map.names == ("embed", "block.0", "norm", "lm_head")
    assert [p.name for p in layer_map["lm_head"].params] == ["base_model.model.lm_head.weight"]


def test_a_compiled_or_checkpoint_wrapped_model_records_the_names_of_the_plain_one():
    """torch.compile's ``_orig_mod.`` and activation checkpointing's ``_checkpoint_wrapped_module.``
    are no part of a recorded name (as torch's own checkpointing strips them): a store written by one
    engine's wrapped model is read by the other's plain one (and the other way round)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    from layercheck.policies.layer_map import canonical_name, model_layer_map

    plain = tiny_model("llama")
    wrapped = tiny_model("llama")
    wrapped.model.layers[0] = checkpoint_wrapper(wrapped.model.layers[0])
    compiled = torch.compile(wrapped)  # an OptimizedModule: nothing compiles before a forward
    names = [name for name, _ in compiled.named_parameters()]
    assert any("_orig_mod." in n for n in names) and any("_checkpoint_wrapped_module." in n for n in names)
    assert model_layer_map(compiled) == model_layer_map(plain) == layer_map_of(compiled)
    assert canonical_name("base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight") == (
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight"  # peft's names are its own
    )
