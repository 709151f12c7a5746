"""``layercheck bench --engine fsdp2``: LayerCheck's strategies on real ``fully_shard`` ranks (gloo)
against the FSDP2 user's own checkpoints, DCP's ``save`` and ``async_save`` every N with rollback,
on the same failure; and DeepSpeed's baselines refused by name with their DCP counterparts."""

from __future__ import annotations

import math

import pytest

from layercheck.bench import report as reports
from layercheck.bench.presets import preset
from layercheck.bench.strategies import default_strategies, select
from layercheck.orchestrator.cli.main import main


def test_deepspeeds_baselines_are_refused_on_fsdp2_naming_dcps(capsys):
    strategies = default_strategies(preset("tiny").strategy, "fsdp2")
    assert {"dcp", "dcp-async"} <= {s.name for s in strategies}
    assert not {"full", "full-async"} & {s.name for s in strategies}
    with pytest.raises(ValueError, match=r"full: DeepSpeed's engine.save_checkpoint.*--engine fsdp2.*dcp-async"):
        select(strategies, ["layercheck", "full"], engine="fsdp2")
    with pytest.raises(SystemExit, match=r"dcp-async: torch.distributed.checkpoint.async_save.*fsdp2 engine"):
        main(["bench", "--strategies", "layercheck,dcp-async", "--no-matched"])  # the DeepSpeed engine


@pytest.mark.slow
def test_layercheck_against_dcp_async_on_fsdp2_ranks():
    from layercheck.bench.harness import run_benchmark

    workload = preset("tiny", steps=8, failures=(6,), interval=4, layercheck_warmup=2, lr_warmup=2, engine="fsdp2")
    strategies = select(
        default_strategies(workload.strategy, "fsdp2"), ["layercheck", "dcp", "dcp-async"], engine="fsdp2"
    )
    raw = run_benchmark(workload, strategies, matched=True)
    results = raw["results"]
    assert [n for n in results if not n.startswith("_")] == [
        "none",
        "layercheck",
        "dcp",
        "dcp-async",
        "dcp-async@stal",
        "dcp-async@drift",
        "dcp-async@bytes",
    ]
    for name, result in results.items():
        if name.startswith("_"):
            continue
        losses = result["losses"]
        assert len(losses) == 8 and all(math.isfinite(v) for v in losses.values()), name
        # before the failure every strategy trains exactly like the reference
        assert [losses[str(s)] for s in range(1, 7)] == [results["none"]["losses"][str(s)] for s in range(1, 7)]
    (lc_recovery,) = results["layercheck"]["recoveries"]
    assert lc_recovery["resume_after"] == 6 and lc_recovery["steps_lost"] == 0
    for name in ("dcp", "dcp-async"):
        (recovery,) = results[name]["recoveries"]
        assert recovery["resume_after"] == 4 and recovery["steps_lost"] == 2, name
        assert recovery["replay_max_loss_diff"] == 0.0, name  # dcp.load then re-running the lost steps is exact
        assert results[name]["events"] == 2 and results[name]["bytes_written"] > 0, name  # after steps 4 and 8

    report = reports.build_report(raw, workload.to_json(), {"nproc": 2})
    side, rows = report["headline"]["vs_dcp_async"], report["strategies"]
    # LayerCheck against the dcp-async run nearest it in bytes (at N, or at a matched interval)
    written = rows["layercheck"]["bytes_written"]
    nearest = min(side["baselines"], key=lambda n: abs(math.log(written / rows[n]["bytes_written"])))
    assert side["by_strategy"]["layercheck"]["at_bytes"]["baseline"] == nearest
    assert side["by_strategy"]["layercheck"]["steps_lost"] == 0
    assert report["strategies"]["dcp-async"]["critical_s"] > 0
