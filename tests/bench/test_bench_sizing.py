"""The sizing arithmetic of docs/cluster.md (``bench/scale/sizing.py``), on hand-made measurements:
bytes and requests per step, a writer's memory, death to the next step, ETTR against DCP async."""

from __future__ import annotations

import math

import pytest

from layercheck.bench import ettr as ettr_model
from layercheck.bench.scale import sizing
from layercheck.bench.scale.costs import ScaleCosts
from layercheck.bench.scale.shapes import LLAMA31_70B, QWEN25_7B
from layercheck.orchestrator.core.memory.budget import memory_version_need

QWEN, LLAMA = sizing.MODELS
A = sizing.Assumptions()


def _measured(plan_s: float = 0.5) -> sizing.Measured:
    return sizing.Measured(
        scale=ScaleCosts(plan_points=((8, plan_s), (64, plan_s)), cpu_points=((8, 0.1), (64, 0.4)), latency_points=()),
        in_place=sizing.Phases(restart=0.0, group=0.5),
        spare=sizing.Phases(restart=0.2, group=0.1),
        full_restart=sizing.Phases(restart=0.0, group=0.0),
        gpu_cold_start_s=12.0,
        probe_s_per_element=1e-12,
        copy_bytes_per_s=50e9,
    )


def test_what_a_run_writes_and_holds():
    f = sizing.footprint(QWEN, 64, _measured(), A)
    state = QWEN25_7B.numel * 12
    assert (f.nodes, f.state_bytes, f.state_per_gpu) == (8, state, state / 64)
    assert f.bytes_per_step == state / 100 and f.node_bytes_per_step == pytest.approx(state / 100 / 8)
    # per version of a layer: a file per rank and the record; a size check per file; one listing of epochs/
    assert f.requests_per_step == pytest.approx({"PUT": 0.31 * 65, "HEAD": 0.31 * 64, "LIST": 0.31})
    # one writer a node: its 8 ranks' memory version and its mirror peer's 8
    assert f.memory_per_node == memory_version_need(QWEN25_7B.layer_numel(), world_size=64, ranks=16).nbytes
    # "auto": the smallest period whose copy is within 1% of a 1 s step
    assert f.memory_period == math.ceil(state / 64 / 50e9 / 0.01)
    assert (
        sizing.footprint(QWEN, 8, _measured(), A).memory_per_node
        == memory_version_need(QWEN25_7B.layer_numel(), world_size=8, ranks=8).nbytes
    )  # one node: no mirror
    assert f.fits and not sizing.footprint(LLAMA, 8, _measured(), A).fits  # 70B on 8 GPUs: 141 GB a GPU
    assert sizing.footprint(LLAMA, 1024, _measured(), A).state_per_gpu == LLAMA31_70B.numel * 12 / 1024


def test_death_to_the_next_step_overlaps_the_plan_with_the_build():
    m = _measured(plan_s=0.5)
    f = sizing.footprint(QWEN, 64, m, A)
    r = sizing.recovery(QWEN, f, m, A)
    load_rank = f.state_per_gpu / A.node_read_bytes_per_s  # the replacement alone reads
    assert r.in_place_s == pytest.approx(0.0 + 0.5 + QWEN.cold_start_s + load_rank + A.step_s)
    assert r.spare_s == pytest.approx(0.2 + 0.1 + QWEN.rebuild_s + load_rank + A.step_s)
    assert r.dcp_restart_s == pytest.approx(QWEN.cold_start_s + 8 * f.state_per_gpu / A.node_read_bytes_per_s + 1)
    slow = sizing.recovery(QWEN, f, _measured(plan_s=40.0), A)  # a plan past the rebuild decides the spare's path
    drain = A.inflight_bytes_per_rank * 8 / A.node_write_bytes_per_s  # the node's in-flight bound, written first
    assert slow.spare_s == pytest.approx(0.2 + 0.1 + drain + 40.0 + load_rank + A.step_s)
    assert r.control_s == 0.0 and r.probe_s == pytest.approx(1e-12 * QWEN25_7B.numel / 64)
    assert r.memory_s == pytest.approx(f.memory_copy_s / f.memory_period) and r.memory_s <= 0.01 * A.step_s
    busy = sizing.recovery(QWEN, sizing.footprint(QWEN, 1024, m, A), m, A)  # CPU 0.4 s at 64, extrapolated
    assert busy.control_s == pytest.approx(0.4 + 0.3 / 56 * 960 - 1.0)


def test_ettr_against_dcp_async_with_a_rollback():
    m = _measured()
    f = sizing.footprint(QWEN, 1024, m, A)
    r = sizing.recovery(QWEN, f, m, A)
    llama3, opt = sizing.FAILURE_RATES
    assert llama3.per_gpu_mtbf_hours == pytest.approx(16_384 * 54 * 24 / 419)
    e = sizing.ettr(f, r, opt, A)
    assert e.mtbf_hours == pytest.approx(opt.per_gpu_mtbf_hours / 1024)
    # async: never a checkpoint before the last one is written at LayerCheck's bandwidth (a period)
    assert e.dcp_interval_steps >= A.period
    mtbf_s = e.mtbf_hours * 3600
    overhead = r.probe_s + r.memory_s + r.control_s
    spare = ettr_model.resume_ettr(
        ettr_model.Costs(
            name="x", recovery="resume", base_step_s=1.0, step_s=1.0 + overhead, restart_s=r.spare_s - 1.0
        ),
        mtbf_s,
    )
    assert e.spare == pytest.approx(spare) and e.spare_without_memory > e.spare
    assert e.in_place < e.spare  # the cold start against the rebuild
    rare = sizing.ettr(sizing.footprint(QWEN, 8, m, A), r, llama3, A)  # fails every 6,000 h: Young's interval
    assert rare.dcp_interval_steps > A.period


def test_the_section_leaves_out_what_does_not_fit_and_names_its_sources(tmp_path):
    text = sizing.section(_measured())
    assert text.count("| Qwen2.5-7B |") == 4 * 4  # four GPU counts in each of four tables
    assert text.count("| Llama-3.1-70B |") == 4 + 3 * 3  # 8 GPUs: only in the first table
    assert "Llama-3.1-70B on 8 GPUs" in text and "arxiv.org/abs/2407.21783" in text
    assert sizing.IN_PLACE_JSON in text and sizing.SCALE_JSON in text
    page = f"before\n{sizing.BEGIN}\nold\n{sizing.END}\nafter\n"
    assert sizing.SECTION.part(page) == "old"
    written = tmp_path / "page.md"
    written.write_text(page)
    sizing.SECTION.write_into(written, "new")  # the section replaced, the rest of the page kept
    assert written.read_text() == f"before\n{sizing.BEGIN}\nnew\n{sizing.END}\nafter\n"
