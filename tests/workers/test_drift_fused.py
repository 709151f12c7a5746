"""DriftAdamW's fused step: torch AdamW's parameters and moments, and the drift that
snapshot-and-diff measures, without an update tensor.

CPU always (the torch path, bit-equal to ``torch.optim.AdamW(foreach=False)``); CUDA with
``LAYERCHECK_TEST_DEVICE=cuda`` (the Triton kernel, within float tolerance of torch's fused
AdamW); the kernel's arithmetic on CPU under Triton's interpreter where Triton is installed.
"""

from __future__ import annotations

import operator
import os

import pytest
import torch

from layercheck.workers.drift import fused as drift_fused
from layercheck.workers.drift.adamw import DriftAdamW
from layercheck.workers.drift.choice import choose_steps
from layercheck.workers.drift.fused import adamw_l1_torch, triton_eligible
from layercheck.workers.drift.fused_work import AdamWScalars, work_rows
from tests.support.checkout import probe
from tests.support.devices import devices, require

SHAPES = [(40, 33), (700,), (3, 5, 7), (1,)]
HYPER = {"lr": 3e-3, "betas": (0.9, 0.95), "eps": 1e-7}


def _groups(params):
    """Three groups with different lr / weight decay, as the layer-aligned groups are."""
    return [
        {"params": params[:2], "weight_decay": 0.1, "name": "a/decay"},
        {"params": params[2:3], "weight_decay": 0.0, "lr": 1e-3, "name": "a/no_decay"},
        {"params": params[3:], "weight_decay": 0.05, "name": "b/decay"},
    ]


def _copies(device, seed=0):
    torch.manual_seed(seed)
    base = [torch.randn(*s) for s in SHAPES]
    return [[t.clone().to(device).requires_grad_(True) for t in base] for _ in range(3)]


def _set_grads(step, *param_lists):
    g = torch.Generator().manual_seed(1000 + step)
    grads = [torch.randn(p.shape, generator=g) for p in param_lists[0]]
    for params in param_lists:
        for p, grad in zip(params, grads):
            p.grad = grad.to(p.device)


@pytest.mark.parametrize("device", devices())
def test_fused_step_matches_torch_adamw_and_snapshot_diff(device, monkeypatch):
    dev = require(device)
    monkeypatch.setattr(drift_fused, "TORCH_CHUNK", 64)  # several chunks per tensor on the torch path
    fused_p, ref_p, foreach_p = _copies(dev)
    if dev.type == "cuda":
        assert triton_eligible(fused_p), "the CUDA case must run the Triton kernel (is triton installed?)"
    fused = DriftAdamW(_groups(fused_p), **HYPER, drift_step="fused")
    foreach = DriftAdamW(_groups(foreach_p), **HYPER)
    reference_kwargs = {"fused": True} if dev.type == "cuda" else {"foreach": False}
    reference = torch.optim.AdamW(
        [{k: v for k, v in g.items() if k != "name"} for g in _groups(ref_p)], **HYPER, **reference_kwargs
    )
    for step in range(5):
        _set_grads(step, fused_p, ref_p, foreach_p)
        before = {id(p): p.detach().clone() for p in fused_p}
        fused.step()
        reference.step()
        foreach.step()
        drift, foreach_drift = fused.take_drift(), foreach.take_drift()
        for group in fused.param_groups:
            diff = sum(float((p.detach() - before[id(p)]).abs().double().sum()) for p in group["params"])
            assert drift[group["name"]].item() == pytest.approx(diff, rel=1e-6), group["name"]
            assert foreach_drift[group["name"]].item() == pytest.approx(diff, rel=1e-4), group["name"]
    for p, q in zip(fused_p, ref_p):
        for ours, theirs in ((p, q), *((fused.state[p][k], reference.state[q][k]) for k in ("exp_avg", "exp_avg_sq"))):
            if dev.type == "cpu":
                assert torch.equal(ours, theirs)  # op for op: bit-equal
            else:
                torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-7)
        assert float(fused.state[p]["step"]) == float(reference.state[q]["step"]) == 5


@pytest.mark.parametrize("device", devices())
def test_fused_step_counts_only_the_windows(device):
    dev = require(device)
    (params, _, _) = _copies(dev, seed=1)
    opt = DriftAdamW(_groups(params), **HYPER, drift_step="fused")
    opt.set_drift_windows(params[0], [(0, 40), (500, 33), (1200, 120)])
    opt.set_drift_windows(params[2], [])  # a tensor of which this rank owns nothing
    expected = 0.0
    for step in range(2):
        _set_grads(step, params)
        before = [p.detach().clone().view(-1) for p in params[:2]]
        opt.step()
        diff = (params[0].detach().view(-1) - before[0]).abs().double()
        expected += float(diff[0:40].sum() + diff[500:533].sum() + diff[1200:1320].sum())
        expected += float((params[1].detach().view(-1) - before[1]).abs().double().sum())  # no windows: all
    drift = opt.take_drift()
    assert drift["a/decay"].item() == pytest.approx(expected, rel=1e-6)
    assert "a/no_decay" not in drift  # owns nothing: no entry, as the foreach step
    assert set(drift) == {"a/decay", "b/decay"}
    assert opt.take_drift() == {}


def test_step_counts_stay_torchs_whoever_reads_writes_or_replaces_them():
    """The fused step keeps its step counts in one tensor (a view of it in each state): they stay
    0-d float32 tensors that save and load; a count written (``fill_``) or a tensor replaced by
    someone else steps on from there; sets of groups stepped in turn (as ZeRO-3 steps its
    sub-groups) each count their own; and through all of it the update is torch's AdamW's, bit
    for bit."""
    import io

    fused_p, ref_p, _ = _copies("cpu", seed=2)
    fused = DriftAdamW(_groups(fused_p), **HYPER, drift_step="fused")
    reference = torch.optim.AdamW(
        [{k: v for k, v in g.items() if k != "name"} for g in _groups(ref_p)], **HYPER, foreach=False
    )

    def step(n, groups=slice(None)):
        _set_grads(n, fused_p, ref_p)
        fused_groups, reference_groups = fused.param_groups, reference.param_groups
        fused.param_groups, reference.param_groups = fused_groups[groups], reference_groups[groups]
        fused.step()
        reference.step()
        fused.param_groups, reference.param_groups = fused_groups, reference_groups

    def counts():
        return [float(fused.state[p]["step"]) for p in fused_p]

    for n in range(3):
        step(n)
    assert all(fused.state[p]["step"].dim() == 0 and fused.state[p]["step"].dtype == torch.float32 for p in fused_p)
    assert counts() == [3.0] * 4

    for opt, params in ((fused, fused_p), (reference, ref_p)):
        opt.state[params[0]]["step"].fill_(10.0)  # as optim_state.set_step does
        opt.state[params[3]]["step"] = torch.tensor(7.0)  # a replaced tensor
    step(3)
    assert counts() == [11.0, 4.0, 4.0, 8.0]

    saved = io.BytesIO()
    torch.save(fused.state_dict(), saved)
    saved.seek(0)
    fused = DriftAdamW(_groups(fused_p), **HYPER, drift_step="fused")
    fused.load_state_dict(torch.load(saved))
    step(4)
    for n in range(5, 9):
        step(n, slice(0, 2) if n % 2 else slice(2, 3))
    assert counts() == [14.0, 7.0, 7.0, 11.0]
    for p, q in zip(fused_p, ref_p):
        assert float(fused.state[p]["step"]) == float(reference.state[q]["step"])
        for ours, theirs in ((p, q), *((fused.state[p][k], reference.state[q][k]) for k in ("exp_avg", "exp_avg_sq"))):
            assert torch.equal(ours, theirs)

    fused.measuring = False  # unmeasured steps are torch's own, counting in the same tensors
    step(9)
    step(10)
    fused.measuring = True
    step(11)
    assert counts() == [17.0, 10.0, 10.0, 14.0]


def test_the_fused_step_keeps_its_work_across_steps_and_notices_what_changes():
    """The fused step's per-tensor work (states, windows, the kernel's tables) is kept from step to
    step; a moment replaced, a parameter's state replaced, a gradient dropped, a state dict loaded into the same optimizer, new
    windows or a new param group are each noticed, and the update stays torch's AdamW's, bit for
    bit, with the drift counted over the windows of the moment."""
    fused_p, ref_p, _ = _copies("cpu", seed=3)
    fused = DriftAdamW(_groups(fused_p), **HYPER, drift_step="fused")
    reference = torch.optim.AdamW(
        [{k: v for k, v in g.items() if k != "name"} for g in _groups(ref_p)], **HYPER, foreach=False
    )

    def step(n, drop=None):
        _set_grads(n, fused_p, ref_p)
        if drop is not None:  # a parameter without a gradient is not stepped
            fused_p[drop].grad = ref_p[drop].grad = None
        before = [p.detach().clone() for p in fused_p]
        fused.step()
        reference.step()
        return [float((p.detach() - b).abs().double().sum()) for p, b in zip(fused_p, before)]

    def same():
        for p, q in zip(fused_p, ref_p):
            for ours, theirs in (
                (p, q),
                *((fused.state[p][k], reference.state[q][k]) for k in ("exp_avg", "exp_avg_sq")),
            ):
                assert torch.equal(ours, theirs)

    step(0)
    (plan,) = fused._plans.values()
    step(1)
    assert len(fused._plans) == 1 and next(iter(fused._plans.values())) is plan  # kept
    same()

    for opt, params in ((fused, fused_p), (reference, ref_p)):  # a moment replaced by someone else
        opt.state[params[1]]["exp_avg"] = opt.state[params[1]]["exp_avg"] * 0.5
    step(2)
    same()
    for opt, params in ((fused, fused_p), (reference, ref_p)):  # a parameter's whole state replaced
        opt.state[params[2]] = {
            k: v.clone() * (0.5 if k == "exp_avg_sq" else 1) for k, v in opt.state[params[2]].items()
        }
    step(2)
    same()
    step(3, drop=2)  # a group without a gradient this step
    same()
    step(4)
    fused.load_state_dict(fused.state_dict())  # the same state, in new tensors
    step(5)
    same()

    fused.set_drift_windows(fused_p[0], [(3, 10)])
    fused.take_drift()
    before = fused_p[0].detach().clone().view(-1)
    moved = step(6)
    drift = fused.take_drift()
    in_window = float((fused_p[0].detach().view(-1) - before)[3:13].abs().double().sum())
    assert drift["a/decay"].item() == pytest.approx(in_window + moved[1], rel=1e-6)

    extra, extra_ref = torch.randn(17, requires_grad=True), None
    extra_ref = extra.detach().clone().requires_grad_(True)
    fused.add_param_group({"params": [extra], "weight_decay": 0.0, "name": "c"})
    reference.add_param_group({"params": [extra_ref], "weight_decay": 0.0})
    fused_p.append(extra)
    ref_p.append(extra_ref)
    step(7)
    step(8)
    same()
    assert set(fused.take_drift()) == {"a/decay", "a/no_decay", "b/decay", "c"}


def test_a_groups_sub_groups_stepped_in_turn_each_keep_their_work():
    """ZeRO-3 steps a param group one sub-group at a time, putting each sub-group's flat tensor in
    the group's ``params`` before the step: each keeps a plan of its own, and the update stays
    torch's AdamW's, bit for bit."""
    fused_p, ref_p, _ = _copies("cpu", seed=6)
    fused = DriftAdamW([{"params": [], "weight_decay": 0.1, "name": "g"}], **HYPER, drift_step="fused")
    reference = torch.optim.AdamW([{"params": [], "weight_decay": 0.1}], **HYPER, foreach=False)
    for step in range(6):
        _set_grads(step, fused_p, ref_p)
        for p, q in zip(fused_p, ref_p):  # as stage 3's _optimizer_step, per sub-group
            fused.param_groups[0]["params"], reference.param_groups[0]["params"] = [p], [q]
            fused.step()
            reference.step()
    assert len(fused._plans) == len(fused_p)
    for p, q in zip(fused_p, ref_p):
        for ours, theirs in ((p, q), *((fused.state[p][k], reference.state[q][k]) for k in ("exp_avg", "exp_avg_sq"))):
            assert torch.equal(ours, theirs)


def test_torch_path_is_bit_equal_whatever_the_chunk():
    torch.manual_seed(3)
    p, g, m, v = (torch.randn(1000) for _ in range(4))
    v = v.abs()
    scalars = AdamWScalars(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, step=3)
    results = []
    for chunk in (7, 128, 1000, 4096):
        state = [t.clone() for t in (p, g, m, v)]
        l1 = adamw_l1_torch(*state, ((10, 300), (400, 5)), scalars, chunk=chunk)
        results.append((state, l1))
    for state, l1 in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(state, results[0][0]))
        assert l1.item() == pytest.approx(results[0][1].item(), rel=1e-6)  # fp32 partial sums
    delta = (results[0][0][0] - p).abs().double()
    assert results[0][1].item() == pytest.approx(float(delta[10:310].sum() + delta[400:405].sum()), rel=1e-9)


def test_work_rows_partition_each_tensor_with_one_counted_run_per_row():
    numels = [10, 7, 0, 5]
    windows = [((1, 2), (4, 1), (8, 2)), None, None, ()]
    rows = work_rows(numels, windows, chunk=4)
    for index, numel in enumerate(numels):
        mine = sorted((start, stop) for t, start, stop, *_ in rows if t == index)
        covered = [i for start, stop in mine for i in range(start, stop)]
        assert covered == list(range(numel)), index  # every element updated exactly once
    counted = {t: set() for t in range(len(numels))}
    by_run: dict[tuple[int, int], set[int]] = {}
    for t, start, stop, lo, hi, run in rows:
        assert start <= lo <= hi <= stop and stop - start <= 4
        counted[t].update(range(lo, hi))
        by_run.setdefault((t, run), set()).update(range(lo, hi))
    assert counted == {0: {1, 2, 4, 8, 9}, 1: set(range(7)), 2: set(), 3: set()}
    # each counted element is told which of its tensor's windows it is in (a layer's, in a flat partition)
    assert {key: elements for key, elements in by_run.items() if elements} == {
        (0, 0): {1, 2},
        (0, 1): {4},
        (0, 2): {8, 9},
        (1, 0): set(range(7)),
    }
    with pytest.raises(ValueError, match="chunk"):
        work_rows([3], [None], chunk=0)


def test_triton_kernel_under_the_interpreter():
    """The CUDA kernel's arithmetic, work table and slots, run by Triton's CPU interpreter (Triton
    is not a dependency: ``pip install triton`` and run with ``TRITON_INTERPRET=1``): one launch
    for three groups with their own learning rate, weight decay (none for one), beta1 (both lerp
    forms) and step count, each group's count in its own slot."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("set TRITON_INTERPRET=1 (with triton installed) to run the CUDA kernel on CPU")
    pytest.importorskip("triton")
    from layercheck.workers.drift.fused_work import FusedGroup
    from layercheck.workers.drift.triton_step import adamw_l1_triton_groups

    torch.manual_seed(4)
    specs = [
        ([(64, 100), (5000,), (7,)], (((0, 2000), (2500, 3000)), None, ()), dict(lr=1e-2, weight_decay=0.1, step=2)),
        ([(300,)], (None,), dict(lr=3e-3, weight_decay=0.0, step=1)),
        ([(129,), (40000,)], (((5, 10),), None), dict(lr=5e-4, weight_decay=0.05, step=7, beta1=0.3)),
    ]
    groups, references = [], []
    for shapes, windows, kw in specs:
        tensors = [[torch.randn(s) for s in shapes] for _ in range(4)]
        for v in tensors[3]:
            v.abs_()
        scalars = AdamWScalars(beta1=kw.pop("beta1", 0.9), beta2=0.999, eps=1e-8, **kw)
        groups.append(
            FusedGroup(
                params=tensors[0],
                grads=tensors[1],
                exp_avgs=tensors[2],
                exp_avg_sqs=tensors[3],
                windows=windows,
                scalars=scalars,
            )
        )
        references.append(([[t.clone() for t in ts] for ts in tensors], windows, scalars))
    l1 = adamw_l1_triton_groups(groups)
    assert l1.dtype == torch.float64 and l1.shape == (3,)
    for group, (ref, windows, scalars), got in zip(groups, references, l1):
        expected = sum(adamw_l1_torch(*quad, w, scalars).item() for *quad, w in zip(*ref, windows))
        for mine, want in zip((group.params, group.grads, group.exp_avgs, group.exp_avg_sqs), ref):
            for a, b in zip(mine, want):
                torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)  # fp32 rounding may differ by an ulp
        assert got.item() == pytest.approx(expected, rel=1e-5)


def test_triton_kernel_on_a_kept_plan_under_the_interpreter():
    """The kernel's launch for a kept plan (Triton's CPU interpreter, as above): three steps, the
    gradients new tensors at the second (the address table rebuilt) and the same at the third
    (kept), against the torch path on a copy of the same plan."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("set TRITON_INTERPRET=1 (with triton installed) to run the CUDA kernel on CPU")
    pytest.importorskip("triton")
    from layercheck.workers.drift.fused import adamw_l1_plan
    from layercheck.workers.drift.fused_work import FusedPlan
    from layercheck.workers.drift.triton_step import adamw_l1_triton_plan

    torch.manual_seed(5)
    shapes, windows = [(64, 100), (5000,), (300,)], [((0, 2000), (2500, 3000)), None, ()]

    def plan(tensors):
        params, exp_avgs, exp_avg_sqs = tensors
        return FusedPlan(
            names=("a", "b"),
            starts=(0, 2, 3),
            params=params,
            states=[{} for _ in params],
            exp_avgs=exp_avgs,
            exp_avg_sqs=exp_avg_sqs,
            windows=list(windows),
            owned=(True, False),
            state_table={},
            triton=False,
        )

    base = [[torch.randn(s) for s in shapes] for _ in range(3)]
    for v in base[2]:
        v.abs_()
    kernel, torch_path = plan([[t.clone() for t in ts] for ts in base]), plan([[t.clone() for t in ts] for ts in base])
    grads = [torch.randn(s) for s in shapes]
    for step, new_grads in ((1, False), (2, True), (3, False)):
        if new_grads:
            grads = [g * 0.5 for g in grads]
        scalars = [
            AdamWScalars(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, step=step),
            AdamWScalars(lr=3e-3, beta1=0.3, beta2=0.999, eps=1e-8, weight_decay=0.0, step=step),
        ]
        addrs = [[t.data_ptr() for t in ts] for ts in kernel.tensor_lists(grads)]
        got = adamw_l1_triton_plan(kernel, addrs, scalars)
        assert kernel.tables["addrs"] == addrs
        expected = adamw_l1_plan(torch_path, grads, scalars)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=0.0)
        for ours, theirs in zip(kernel.tensor_lists(grads), torch_path.tensor_lists(grads)):
            for a, b in zip(ours, theirs):
                torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_triton_kernel_counting_into_layers_under_the_interpreter():
    """The launch for tensors whose windows count into different accumulators (the layers of a
    flat ZeRO partition, for the fused step in place of a user's AdamW), under Triton's CPU
    interpreter, against the torch path: a partition with three layers' runs, a tensor of one
    layer, one that counts nothing, two slots of scalars."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("set TRITON_INTERPRET=1 (with triton installed) to run the CUDA kernel on CPU")
    pytest.importorskip("triton")
    from layercheck.workers.drift.fused import adamw_l1_layers
    from layercheck.workers.drift.fused_work import LayerStep
    from layercheck.workers.drift.triton_step import adamw_l1_triton_layers

    torch.manual_seed(6)
    numels = [40000, 300, 129]
    windows = [((0, 20000), (20000, 15000), (36000, 4000)), ((0, 300),), ()]
    accumulators = [(0, 1, 2), (1,), ()]
    slots = [0, 1, 0]
    scalars = [
        AdamWScalars(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, step=3),
        AdamWScalars(lr=3e-3, beta1=0.3, beta2=0.999, eps=1e-8, weight_decay=0.0, step=1),
    ]
    base = [[torch.randn(n) for n in numels] for _ in range(4)]
    for v in base[3]:
        v.abs_()
    kernel, torch_path = ([[t.clone() for t in ts] for ts in base] for _ in range(2))

    def step(tensors):
        p, g, m, v = tensors
        return LayerStep(
            params=p,
            grads=g,
            exp_avgs=m,
            exp_avg_sqs=v,
            windows=windows,
            accumulators=accumulators,
            slots=slots,
            scalars=scalars,
            count=4,
        )

    got = adamw_l1_triton_layers(step(kernel))
    expected = adamw_l1_layers(step(torch_path))
    assert got.dtype == torch.float64 and got.shape == (4,) and got[3] == 0 and expected[3] == 0
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=0.0)
    for ours, theirs in zip(kernel, torch_path):
        for a, b in zip(ours, theirs):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)  # fp32 rounding may differ by an ulp


def test_triton_kernel_compiles_for_hopper():
    """The kernel compiles to a cubin for sm_90 (H100/H200) with Triton's own ptxas, no GPU
    needed (Triton is not a dependency: skipped where it does not import)."""
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("under TRITON_INTERPRET=1 the kernel is interpreted, not compiled")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from layercheck.workers.drift import fused_work as drift_fused_work
    from layercheck.workers.drift import triton_step as drift_triton

    signature = {"rows_ptr": "*i64", "addrs_ptr": "*i64", "scalars_ptr": "*fp32", "acc_ptr": "*fp64"}
    constexprs = {
        "CHUNK": drift_fused_work.TRITON_CHUNK,
        "BLOCK": drift_triton.BLOCK,
        "ROW": drift_triton.ROW,
        "ADDRS": drift_triton.ADDRS,
        "SCALARS": drift_triton.SCALARS,
    }
    source = ASTSource(
        fn=drift_triton._adamw_l1_kernel,
        signature={**signature, **dict.fromkeys(constexprs, "constexpr")},
        constexprs={(len(signature) + i,): value for i, value in enumerate(constexprs.values())},
    )
    kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": drift_triton.NUM_WARPS})
    assert kernel.asm["cubin"]


@pytest.mark.parametrize("device", devices())
def test_auto_is_torchs_fused_adamw_copied_and_diffed_measured_or_not(device):
    """The default, ``drift_step="auto"``, picks by the committed figures: on CPU and on CUDA every
    step is torch's fused AdamW, bit for bit (its step counts on the parameters' device, where
    torch keeps them for that kernel), and a measured step's drift is the L1 of what it moved."""
    dev = require(device)
    auto_p, ref_p, _ = _copies(dev, seed=3)
    auto = DriftAdamW(_groups(auto_p), **HYPER)
    assert auto.drift_step == "auto"
    reference = torch.optim.AdamW(
        [{k: v for k, v in g.items() if k != "name"} for g in _groups(ref_p)], **HYPER, fused=True
    )
    for step in range(4):
        auto.measuring = step % 2 == 0
        _set_grads(step, auto_p, ref_p)
        before = [p.detach().clone() for p in auto_p]
        auto.step()
        reference.step()
        drift = {name: value.item() for name, value in auto.take_drift().items()}
        moved = [(p - b).abs().sum().item() for p, b in zip(auto_p, before)]
        expected = {"a/decay": moved[0] + moved[1], "a/no_decay": moved[2], "b/decay": moved[3]}
        assert drift == (pytest.approx(expected, rel=1e-5) if auto.measuring else {})
    assert auto.steps == choose_steps("auto", dev.type)
    assert (auto.steps.measured, auto.steps.torch_step) == ("foreach", "fused")
    for p, q in zip(auto_p, ref_p):
        assert torch.equal(p, q)
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(auto.state[p][key], reference.state[q][key]), key
        assert auto.state[p]["step"].device == reference.state[q]["step"].device == p.device


def test_bad_drift_step_is_rejected():
    with pytest.raises(ValueError, match="drift_step"):
        DriftAdamW([torch.zeros(2, requires_grad=True)], drift_step="triton")


def test_a_kept_plan_checks_new_gradients_alone_and_everything_again_when_storage_moved():
    """Where a loop sets its gradients to ``None`` (or DeepSpeed copies bf16 ones to fp32), every
    measured step brings new gradient tensors: the kept plan asks whether the kernel takes those
    alone, and keeps its work table. A tensor whose storage was swapped under it (an offloading
    optimizer's ``.data =``) has every tensor checked again and the tables built again. With the
    kernel stubbed out (``bench/probes/fused_issue.py``'s stand-in), on CPU tensors taken as CUDA ones."""
    _kernel_launching_nothing = probe("fused_issue")._kernel_launching_nothing
    from layercheck.workers.drift import fused as drift_fused
    from layercheck.workers.drift import fused_work as drift_fused_work
    from layercheck.workers.drift.fused_work import FusedPlan

    params = [torch.randn(n) for n in (300, 20, 7)]
    plan = FusedPlan(
        names=("a", "b"),
        starts=(0, 2, 3),
        params=params,
        states=[{} for _ in params],
        exp_avgs=[torch.zeros_like(p) for p in params],
        exp_avg_sqs=[torch.zeros_like(p) for p in params],
        windows=[None, None, None],
        owned=(True, True),
        state_table={},
    )
    scalars = [AdamWScalars(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, step=1)] * 2
    asked: list[list[torch.Tensor]] = []
    with _kernel_launching_nothing():
        drift_fused.triton_eligible = lambda tensors: asked.append(list(tensors)) or True  # (put back on exit)
        grads = [torch.randn_like(p) for p in params]
        drift_fused.adamw_l1_plan(plan, grads, scalars)
        rows = plan.tables["rows", drift_fused_work.TRITON_CHUNK]
        drift_fused.adamw_l1_plan(plan, grads, scalars)  # nothing new: nothing asked
        assert len(asked) == 1 and len(asked[0]) == 12  # the first launch: all four of each tensor

        grads = [torch.randn_like(p) for p in params]
        drift_fused.adamw_l1_plan(plan, grads, scalars)
        assert len(asked) == 2 and asked[1][0] is params[0] and all(map(operator.is_, asked[1][1:], grads))
        assert plan.tables["rows", drift_fused_work.TRITON_CHUNK] is rows  # kept
        table = plan.tables["addr_table"].view(-1, 4)
        assert table[:, 1].tolist() == [g.data_ptr() for g in grads]  # each tensor's row: param, grad, moments
        assert table[:, 0].tolist() == [p.data_ptr() for p in params]

        params[1].data = params[1].data.clone()  # storage swapped under a parameter
        drift_fused.adamw_l1_plan(plan, grads, scalars)
        assert len(asked) == 3 and len(asked[2]) == 12
        assert plan.tables["addr_table"].view(-1, 4)[1, 0].item() == params[1].data_ptr()
    assert drift_fused.triton_eligible.__name__ == "triton_eligible"
