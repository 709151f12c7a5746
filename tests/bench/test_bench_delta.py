"""The differential baseline's top-k delta with error feedback."""

from __future__ import annotations

import torch

from layercheck.bench import delta
from layercheck.workers.shard import LayerShard, ParamSlice


def _shard(values: torch.Tensor, layer: str = "block.0") -> LayerShard:
    n = values.numel()
    return LayerShard(
        layer=layer,
        step=0,
        rank=0,
        world_size=1,
        slices=(ParamSlice("w", (n,), 0, n),),
        tensors={"fp32": values.clone(), "exp_avg": values.clone() * 2, "exp_avg_sq": values.abs().clone()},
        optimizer_step=0,
    )


def test_encode_sends_the_largest_entries_and_shadow_tracks_exactly_what_was_sent():
    shadow = torch.zeros(10)
    current = torch.tensor([0.0, 5.0, 0.1, -7.0, 0.0, 0.0, 0.2, 0.0, 0.0, 0.0])
    index, values = delta.encode(current, shadow, density=0.2)
    assert sorted(index.tolist()) == [1, 3]
    assert values.dtype == torch.bfloat16
    rebuilt = torch.zeros(10)
    delta.apply(rebuilt, index, values)
    assert torch.equal(rebuilt, shadow)


def test_error_feedback_sends_the_residual_later():
    shadow = torch.zeros(4)
    current = torch.tensor([4.0, 3.0, 2.0, 1.0])
    for _ in range(4):
        delta.encode(current, shadow, density=0.25)
    assert torch.allclose(shadow, current)


def test_replay_from_files_reproduces_the_shadow(tmp_path):
    torch.manual_seed(0)
    base = _shard(torch.randn(100))
    encoder = delta.DeltaEncoder(density=0.05)
    encoder.reset([base])
    state = base.tensors["fp32"].clone()
    for step in range(1, 6):
        state += torch.randn(100) * 0.01
        current = _shard(state)
        nbytes = delta.write_delta(tmp_path, step, 0, encoder.encode([current]))
        assert nbytes > 0
    restored = _shard(base.tensors["fp32"])
    restored.tensors["exp_avg"] = base.tensors["exp_avg"].clone()
    restored.tensors["exp_avg_sq"] = base.tensors["exp_avg_sq"].clone()
    assert delta.replay([restored], tmp_path, range(1, 6), 0) == 5
    for key in ("fp32", "exp_avg", "exp_avg_sq"):
        assert torch.equal(restored.tensors[key], encoder.shadow[("block.0", key)])


def test_top_k_count():
    assert delta.top_k_count(1000, 0.01) == 10
    assert delta.top_k_count(5, 0.01) == 1
    assert delta.top_k_count(0, 0.5) == 0
