"""The FSDP2 layout (``fully_shard`` over a 1-D mesh, torch's AdamW): every layer snapshotted on 2
gloo ranks, written to the real store and restored into the same run gives back the snapshot bit
for bit and replays the next steps' losses exactly; the 2-rank store loads on 1 rank; uneven and
empty shards tile their parameters; placements and optimizers it does not map are refused."""

from __future__ import annotations

import math
import re

import pytest
import torch

from layercheck.policies.layer_map import model_layer_map
from layercheck.workers.engines.fsdp2 import UnsupportedShardingError, build_fsdp2_layout, named_parameters
from layercheck.workers.optim_state import UnsupportedOptimizerError
from tests.support import fsdp2_jobs as jobs
from tests.support.dist_harness import run_jobs


class _Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(8, 4)
        self.layers = torch.nn.ModuleList([torch.nn.Linear(4, 4)])
        self.norm = torch.nn.LayerNorm(4)


def test_a_model_not_sharded_with_fully_shard_is_refused():
    model = _Model()
    with pytest.raises(
        UnsupportedShardingError, match=r"'embed_tokens.weight' is a Parameter, not a DTensor.*fully_shard"
    ):
        build_fsdp2_layout(model, torch.optim.AdamW(model.parameters()), model_layer_map(model))


@pytest.mark.parametrize("optimizer", [torch.optim.SGD, torch.optim.Adagrad])
def test_an_optimizer_other_than_adam_is_refused(optimizer):
    model = _Model()
    with pytest.raises(UnsupportedOptimizerError, match=rf"torch\.optim\.\w+\.{optimizer.__name__} .*AdamW"):
        build_fsdp2_layout(model, optimizer(model.parameters(), lr=0.1), model_layer_map(model))


def test_amsgrad_is_refused():
    model = _Model()
    with pytest.raises(UnsupportedOptimizerError, match="amsgrad"):
        build_fsdp2_layout(model, torch.optim.Adam(model.parameters(), amsgrad=True), model_layer_map(model))


def test_parameters_are_found_by_their_name_without_wrappers():
    """An activation-checkpoint wrapper's prefix is not part of a parameter's name: a layer map
    written without it (another engine's store) finds the wrapped parameter (torch's FQN mapping)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model = _Model()
    model.layers[0] = checkpoint_wrapper(model.layers[0])
    params = named_parameters(model)
    assert params["layers.0.weight"] is params["layers.0._checkpoint_wrapped_module.weight"]


@pytest.fixture(scope="module")
def ran(tmp_path_factory):
    """The 2-rank run (store, restore, replay; uneven shards with fused AdamW), then in one
    1-rank process: the store loaded, and the refusals."""
    store, expect = (str(tmp_path_factory.mktemp(name)) for name in ("store", "expect"))
    saved, uneven = run_jobs(2, [(jobs.save_and_restore_job, (store, expect)), (jobs.uneven_shards_job, (True,))])
    loaded, refused = run_jobs(1, [(jobs.load_on_fewer_ranks_job, (store, expect)), (jobs.refusals_job, ())])
    return {"saved": saved, "uneven": uneven, "loaded": loaded[0], "refused": refused[0]}


@pytest.mark.slow
def test_restore_from_the_store_gives_back_the_snapshot_and_replays_exactly(ran):
    for rank, r in enumerate(ran["saved"]):
        assert r["moved"] > 0, "training on must move the state"
        assert r["mismatches"] == [], f"rank {rank}: restored state differs from the snapshot"
        # the steps after the restore are the steps after the snapshot, bit for bit
        assert r["replayed"] == r["losses"][jobs.SAVED :]
    rows = {rank: r["owned"]["embed"] for rank, r in enumerate(ran["saved"])}
    assert rows == {
        0: [["model.embed_tokens.weight", 0, 128 * 64]],
        1: [["model.embed_tokens.weight", 128 * 64, 128 * 64]],
    }


@pytest.mark.slow
def test_a_two_rank_store_loads_on_one_rank(ran):
    r = ran["loaded"]
    assert r["keys"] and r["mismatches"] == []
    assert r["adam_steps"] == [jobs.SAVED]
    assert math.isclose(r["probe_loss"], ran["saved"][0]["probe_loss"], rel_tol=1e-6)
    assert math.isfinite(r["next_loss"])


@pytest.mark.slow
def test_uneven_and_empty_shards_tile_their_parameters(ran):
    owned = [r["owned"] for r in ran["uneven"]]
    assert owned[0]["layers.0.w"] == [0, 9] and owned[1]["layers.0.w"] == [9, 6]  # 3 + 2 rows of 3
    assert owned[0]["layers.0.v"] == [0, 4] and "layers.0.v" not in owned[1]  # rank 1 holds no row
    for r in ran["uneven"]:
        assert r["whole"], "all ranks' shards put together must be the full state"
        assert r["restored"] == []


@pytest.mark.slow
@pytest.mark.parametrize(
    "case, message",
    [
        ("shard1", r"UnsupportedShardingError: parameter '[\w.]+' is placed \(Shard\(dim=1\),\) on a 1-D mesh"),
        ("replicate", r"UnsupportedShardingError: parameter 'weight' is placed \(Replicate\(\),\)"),
    ],
)
def test_placements_it_does_not_map_are_refused(ran, case, message):
    assert re.search(message, ran["refused"][case]), ran["refused"][case]


@pytest.mark.slow
def test_hsdps_replicate_by_shard_mesh_is_mapped(ran):
    """HSDP's 2-D mesh (here 1 x 1) is mapped (its replicas: tests/workers/test_hsdp.py)."""
    assert ran["refused"]["hsdp"] == "accepted"
