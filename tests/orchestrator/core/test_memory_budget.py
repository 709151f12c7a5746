"""``persistence.memory_period`` against ``persistence.memory_bytes`` at a run's start: the bytes of
one whole memory version of the ranks a writer holds, and the one-line warning with the budget it
needs when the budget is short of it."""

from __future__ import annotations

import logging

from layercheck.orchestrator.core.memory.budget import (
    FILE_HEADER_BYTES,
    memory_promise_problem,
    memory_version_need,
    most_ranks_on_a_node,
    ranks_per_writer,
    warn_if_unkept,
)

NUMEL = {"embed": 1000, "block.0": 3001, "norm": 10}


def test_a_writer_holds_the_ranks_of_its_node_it_serves_and_its_peers_where_mirrored():
    assert ranks_per_writer(4, 1, mirrored=False) == 4  # every rank on one node, one writer
    assert ranks_per_writer(4, 2, mirrored=False) == 2  # ranks 0 and 2 on writer 0
    assert ranks_per_writer(5, 2, mirrored=False) == 3
    assert ranks_per_writer(4, 2, mirrored=True) == 4  # its own two and its peer's two
    assert ranks_per_writer(8, 4, mirrored=True) == 4
    assert ranks_per_writer(4, 1, mirrored=True) == 4  # own and mirrored ranks: at most the world


def test_a_writer_serves_at_most_the_ranks_one_node_can_hold():
    """At 1,024 GPU ranks on nodes of 8 GPUs, a writer holds 8 ranks' files, not the world's: what
    made a 1,024-rank run warn that a whole model's state had to fit in one writer."""
    nodes = [{"CPU": 96.0, "GPU": 8.0}] * 128 + [{"CPU": 16.0}]  # and a CPU-only head node
    assert most_ranks_on_a_node(1024, {"CPU": 1, "GPU": 1}, nodes) == 8
    assert most_ranks_on_a_node(1024, {"CPU": 4, "GPU": 0}, nodes) == 24  # CPU workers: 96 / 4
    assert most_ranks_on_a_node(4, {"CPU": 1}, nodes) == 4  # never more than the world
    assert most_ranks_on_a_node(16, {}, nodes) == most_ranks_on_a_node(16, {"GPU": 1}, []) == 16  # unknown: all
    assert ranks_per_writer(1024, 1, mirrored=False, per_node=8) == 8
    assert ranks_per_writer(1024, 2, mirrored=True, per_node=8) == 8  # 4 own and a peer's 4
    assert ranks_per_writer(1024, 1, mirrored=False) == 1024  # without a bound: all on one node


def test_a_memory_version_is_each_ranks_even_share_of_every_layer_in_fp32_with_its_headers():
    need = memory_version_need(NUMEL, world_size=2, ranks=2)
    per_rank = (500 + 1501 + 5) * 12 + 3 * FILE_HEADER_BYTES  # weights and both Adam moments, 4 bytes each
    assert (need.nbytes, need.ranks, need.world_size) == (2 * per_rank, 2, 2)
    assert memory_version_need(NUMEL, world_size=2, ranks=1).nbytes == per_rank


def test_a_budget_short_of_a_whole_memory_version_is_told_at_the_start_with_the_budget_it_needs(caplog):
    need = memory_version_need(NUMEL, world_size=2, ranks=2).nbytes
    args = {"world_size": 2, "ranks": 2}
    assert memory_promise_problem(NUMEL, memory_period=1, memory_bytes=need, **args) == ""
    assert memory_promise_problem(NUMEL, memory_period=0, memory_bytes=1, **args) == ""  # no memory versions
    with caplog.at_level(logging.WARNING, logger="layercheck.orchestrator.core.memory.budget"):
        problem = warn_if_unkept(NUMEL, memory_period=1, memory_bytes=need - 1, **args)
    assert problem.startswith("persistence.memory_period = 1 cannot be kept: a memory version of the 2 rank(s) of 2")
    assert f"set persistence.memory_bytes >= {need} to keep it" in problem and "\n" not in problem
    assert [r.getMessage() for r in caplog.records] == [problem]
