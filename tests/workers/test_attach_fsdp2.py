"""What ``attach`` says to what it cannot map, before any step, for FSDP2's way in
(``attach(model, optimizer, lr_scheduler=...)``): FSDP1, a model not sharded with ``fully_shard``,
a DeepSpeed engine given an optimizer, a non-Adam optimizer. (Placements the layout cannot map,
Shard(1) and 2-D meshes: tests/workers/test_fsdp2_layout.py; the whole way in on 2 gloo ranks under
Ray: tests/e2e/test_own_loop_fsdp2.py.)"""

from __future__ import annotations

import pytest
import torch

from layercheck.workers.attached import adapter_for, attach_engine
from layercheck.workers.engines.fsdp2 import FSDP2Adapter, UnsupportedShardingError
from layercheck.workers.optim_state import UnsupportedOptimizerError


@pytest.fixture
def one_rank():
    """A 1-rank gloo group in this process (fully_shard needs one), left after the test."""
    torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
    yield
    torch.distributed.destroy_process_group()


class _Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(8, 4)
        self.layers = torch.nn.ModuleList([torch.nn.Linear(4, 4)])
        self.norm = torch.nn.LayerNorm(4)


def _sharded() -> torch.nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = _Model()
    mesh = init_device_mesh("cpu", (1,))
    fully_shard(model.layers[0], mesh=mesh)
    return fully_shard(model, mesh=mesh)


def test_fsdp1_is_refused_with_what_works():
    """FSDP1 needs an accelerator to wrap a module at all; the refusal reads only the class."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    fsdp1 = FullyShardedDataParallel.__new__(FullyShardedDataParallel)
    torch.nn.Module.__init__(fsdp1)
    fsdp1._fsdp_wrapped_module = torch.nn.Linear(2, 2)  # where FSDP1 forwards attribute lookups
    for model in (fsdp1, torch.nn.Sequential(fsdp1)):
        with pytest.raises(UnsupportedShardingError, match=r"FSDP1's FullyShardedDataParallel.*fully_shard"):
            adapter_for(model, torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))]))


def test_a_model_not_sharded_with_fully_shard_is_refused():
    model = _Model()
    with pytest.raises(UnsupportedShardingError, match=r"_Model is not sharded with fully_shard at its root"):
        attach_engine(model, torch.optim.AdamW(model.parameters()))


def test_a_model_alone_or_a_deepspeed_engine_with_an_optimizer_says_which_call_fits():
    with pytest.raises(TypeError, match=r"or a model sharded with fully_shard and its optimizer.*got _Model alone"):
        attach_engine(_Model())

    class _Engine(torch.nn.Module):  # what DeepSpeed's engine looks like to the adapter
        def zero_optimization_stage(self) -> int:
            return 2

    with pytest.raises(TypeError, match=r"for DeepSpeed call layercheck.attach\(engine\) alone"):
        attach_engine(_Engine(), torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))]))


@pytest.mark.usefixtures("one_rank")
def test_a_non_adam_optimizer_is_refused_before_a_step():
    model = _sharded()
    with pytest.raises(UnsupportedOptimizerError, match=r"SGD .*torch.optim.Adam or torch.optim.AdamW"):
        attach_engine(model, torch.optim.SGD(model.parameters(), lr=0.1))


@pytest.mark.usefixtures("one_rank")
def test_the_adapter_counts_optimizer_steps_and_moves_the_scheduler_on_a_seek():
    model = _sharded()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1 / (s + 1))
    attached = attach_engine(model, optimizer, lr_scheduler=schedule, layer_map={"all": [""]})
    adapter = attached.adapter
    assert isinstance(adapter, FSDP2Adapter) and attached.layout.kind == "fsdp2"
    for _ in range(2):  # steps without gradients: the count is of optimizer steps
        optimizer.step()
        schedule.step()
    assert adapter.steps_taken() == attached.layout.steps_taken() == 2
    assert adapter.current_lr() == pytest.approx(1 / 3)
    fresh_optimizer = torch.optim.AdamW(model.parameters(), lr=1.0)
    fresh = FSDP2Adapter(
        model, fresh_optimizer, torch.optim.lr_scheduler.LambdaLR(fresh_optimizer, lambda s: 1 / (s + 1))
    )
    fresh.seek(5)  # a recovery's: the count and a fresh scheduler stepped 5 times, as training would have
    assert fresh.steps_taken() == 5 and fresh.current_lr() == pytest.approx(1 / 6)


def test_a_lora_adapter_under_fully_shard_is_tracked_alone_on_two_ranks():
    """peft's LoRA on the tiny Llama, sharded with fully_shard on 2 gloo ranks: only the adapter's
    parameters are layers (the frozen base is not), each rank snapshots its half of them, and the
    drift is measured. (The store is the same as DeepSpeed's: a LoRA run's export,
    tests/orchestrator/offline/test_export_peft.py.)"""
    from tests.support.dist_harness import run_ranks
    from tests.support.fsdp2_attach_jobs import lora_job

    ranks = run_ranks(lora_job, 2)
    numel = ranks[0]["numel"]
    assert set(numel) == {"block.0", "block.1"} and ranks[1]["numel"] == numel
    assert all("lora_" in name for name in ranks[0]["params"]), ranks[0]["params"]
    for layer, total in numel.items():
        assert sum(rank["snapshot"][layer] for rank in ranks) == total  # the two halves tile the layer
        assert all(rank["drift"][layer] > 0 for rank in ranks)
    assert [rank["step"] for rank in ranks] == [2, 2]


@pytest.mark.usefixtures("one_rank")
def test_hsdp_in_place_on_gloo_is_refused_before_a_step():
    """Under HSDP a gloo survivor may wait on a live peer in its replicate or shard group, which
    torch never releases (measured: only the peer's process exit does): in place is refused there."""
    from types import SimpleNamespace

    from layercheck.worker import _check_in_place

    hsdp = SimpleNamespace(layout=SimpleNamespace(subgroups=True))
    with pytest.raises(ValueError, match=r"in-place recovery .* HSDP model on gloo.*NCCL.*without in_place"):
        _check_in_place(hsdp, True)
    _check_in_place(hsdp, False)  # a full restart recovers it
    _check_in_place(SimpleNamespace(layout=SimpleNamespace(subgroups=False)), True)
