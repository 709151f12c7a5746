"""The drift probe around a user's optimizer step (workers/drift/hooks.py), on torch alone: the
fused step in place of torch's AdamW is bit-equal to it, the counts are each layer's exact L1,
and what it cannot replace it says. (Under DeepSpeed ZeRO 0-3: tests/workers/test_attach_engine.py.)"""

from __future__ import annotations

import warnings

import pytest
import torch

from layercheck.policies.configs import drift_measured
from layercheck.workers.drift.fused import TORCH_CHUNK
from layercheck.workers.drift.hooks import FUSED_IN_PLACE, StepHookProbe, fused_refusal
from layercheck.workers.layout import LayerLayout, Piece, StateLayout
from layercheck.workers.shard import ParamSlice
from tests.support.devices import devices, require

#: A flat "partition" holding two layers end to end (as ZeRO 1-3 hand the optimizer; longer than
#: the torch path's chunk, the layers' edge inside its first), and a parameter of its own for a
#: third: (layer, master index, start, length).
PIECES = [("a", 0, 0, 200_003), ("b", 0, 200_003, 100_004), ("b", 1, 0, 50), ("c", 2, 0, 64)]
SIZES = (300_007, 50, 64)
NUMEL = {"a": 200_003, "b": 100_054, "c": 64}


def masters(device: str | torch.device = "cpu") -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(n, generator=g).to(device)) for n in SIZES]


def layout(optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter]) -> StateLayout:
    layers = {}
    for name in dict.fromkeys(name for name, *_ in PIECES):
        owned = tuple(
            Piece(ParamSlice(f"{name}.{i}", (length,), 0, length), params[i], start)
            for layer, i, start, length in PIECES
            if layer == name
        )
        layers[name] = LayerLayout(
            name=name,
            owned=owned,
            needed=(),
            masters=tuple({id(p.master): p.master for p in owned}.values()),
            groups=(),
        )
    return StateLayout(stage=1, rank=0, world_size=1, layers=layers, layer_map=None, optimizer=optimizer)


def adamw(params: list[torch.nn.Parameter], **kind) -> torch.optim.AdamW:
    groups = [{"params": params[:1], "weight_decay": 0.1}, {"params": params[1:], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=3e-2, **kind)


def train(optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter], probe=None, steps: int = 5):
    """``steps`` steps on fixed gradients; each step's exact per-layer L1 (from full copies) and,
    with ``probe``, what it read."""
    g = torch.Generator().manual_seed(1)
    exact, read = [], []
    for step in range(1, steps + 1):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g).to(p.device)
        before = [p.detach().clone() for p in params]
        optimizer.step()
        l1 = dict.fromkeys(("a", "b", "c"), 0.0)
        for layer, i, start, length in PIECES:
            l1[layer] += float((params[i].detach() - before[i])[start : start + length].abs().double().sum())
        exact.append(l1)
        if probe is not None:
            read.append(probe.collect(step))
    return exact, read


@pytest.mark.parametrize("kind", [{}, {"foreach": False}, {"foreach": True}], ids=["default", "single", "foreach"])
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "copy"])
def test_the_probe_leaves_the_users_step_bit_for_bit_and_counts_each_layer(kind, fused):
    assert SIZES[0] > TORCH_CHUNK > PIECES[0][3]
    untouched = masters()
    reference = adamw(untouched, **kind)
    exact, _ = train(reference, untouched)
    params = masters()
    optimizer = adamw(params, **kind)
    probe = StepHookProbe(layout(optimizer, params), every=2, fused=fused)
    _, read = train(optimizer, params, probe)
    for p, q in zip(params, untouched):
        assert torch.equal(p, q)
        mine, theirs = optimizer.state[p], reference.state[q]
        assert mine.keys() == theirs.keys() == {"step", "exp_avg", "exp_avg_sq"}
        for key in mine:
            assert torch.equal(mine[key], theirs[key]) and mine[key].dtype == theirs[key].dtype, key
    assert [d.measured for d in read] == [drift_measured(step, 2) for step in range(1, 6)]
    for drift, l1 in zip(read, exact):
        assert drift.cost.probe == (FUSED_IN_PLACE if fused else "step_hooks")
        assert drift.cost.measured == drift.measured
        # the user's own step, which a fused step replaces, is timed on the step after each
        # measured one (steps 2 and 4 here); the copying probe adds to the step and times nothing
        timed = fused and not drift.measured
        assert drift.cost.own_steps == int(timed) and (drift.cost.own_step_s > 0) == timed, (drift.step, drift.cost)
        assert drift.cost.replaced == (fused and drift.measured)
        if drift.measured:
            assert drift.l1 == pytest.approx(l1, rel=1e-6)  # (float32 sums)
            assert drift.numel == NUMEL
    assert all(p.grad is not None for p in params)  # the gradients given back after the fused step


@pytest.mark.parametrize("device", devices())
def test_asked_for_on_cuda_the_fused_step_is_one_kernel_within_rounding_of_torchs(device):
    """``drift_probe="fused"`` on CUDA (``exact=False``): the Triton kernel, each run counted into
    its layer, within float rounding of torch's own (foreach) step; ``auto`` does not take it there."""
    dev = require(device)
    untouched = masters(dev)
    exact, _ = train(adamw(untouched), untouched)
    params = masters(dev)
    optimizer = adamw(params)
    if dev.type == "cuda":
        assert "not bit-equal" in fused_refusal(optimizer)
    probe = StepHookProbe(layout(optimizer, params), fused=True, exact=False)
    _, read = train(optimizer, params, probe)
    for p, q in zip(params, untouched):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    for drift, l1 in zip(read, exact):
        assert drift.l1 == pytest.approx(l1, rel=1e-4)


def test_an_lr_scheduler_still_sees_the_step_and_a_closure_falls_back_to_copying():
    params = masters()
    optimizer = adamw(params)
    probe = StepHookProbe(layout(optimizer, params), fused=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.9**s)
    for p in params:
        p.grad = torch.ones_like(p)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "lr_scheduler.step() before optimizer.step()"
        optimizer.step()
        scheduler.step()
    first = probe.collect(1)
    assert first.l1["c"] > 0 and first.cost.replaced  # the fused step, in place of torch's
    before = [p.detach().clone() for p in params]

    def closure():
        for p in params:
            p.grad = torch.full_like(p, 0.5)
        return 0.0

    for p in params:
        p.grad = None  # the closure makes them inside the step
    optimizer.step(closure)
    drift = probe.collect(2)
    assert not drift.cost.replaced  # copied and diffed around torch's own step
    assert drift.l1["c"] == pytest.approx(float((params[2].detach() - before[2]).abs().sum()), rel=1e-6)
    assert drift.l1["c"] > 0


@pytest.mark.parametrize("call", ["no arguments", "None", "closure=None"])
def test_how_the_step_is_called_does_not_turn_the_fused_step_off(call):
    """accelerate calls ``optimizer.step(closure)`` with ``closure=None``: still the fused step (its
    clock times the update, not the copies), and a step with no gradients at all moves nothing."""
    params = masters()
    optimizer = adamw(params)
    probe = StepHookProbe(layout(optimizer, params), fused=True)
    optimizer.step()  # no gradients yet: nothing to step, nothing counted
    assert probe.collect(1).l1 == dict.fromkeys("abc", 0.0)
    for p in params:
        p.grad = torch.ones_like(p)
    {"no arguments": lambda: optimizer.step(), "None": lambda: optimizer.step(None)}.get(
        call, lambda: optimizer.step(closure=None)
    )()
    assert probe._copies == [] and probe.collect(2).l1["a"] > 0
    assert all(len(optimizer.state[p]) == 3 for p in params)  # stepped by the fused step, state made as torch does


def test_other_step_hooks_keep_the_users_step_and_a_failed_step_loses_no_gradient():
    """A pre-step hook of the user's after the probe's (clipping, say) must act before the update:
    with other hooks the probe copies and diffs around the user's own step. A step that raised
    after the probe's pre-step hook leaves nothing behind for the next one."""

    def halve(opt, args, kwargs):
        for group in opt.param_groups:
            for p in group["params"]:
                p.grad.mul_(0.5)

    untouched = masters()
    reference = adamw(untouched)
    reference.register_step_pre_hook(halve)
    exact, _ = train(reference, untouched, steps=2)
    params = masters()
    optimizer = adamw(params)
    probe = StepHookProbe(layout(optimizer, params), fused=True)
    optimizer.register_step_pre_hook(halve)
    _, read = train(optimizer, params, probe, steps=2)
    for p, q in zip(params, untouched):
        assert torch.equal(p, q)
    assert read[1].l1 == pytest.approx(exact[1], rel=1e-6)

    def fails(opt, args, kwargs):
        raise RuntimeError("a later hook failed")

    handle = optimizer.register_step_pre_hook(fails)
    grads = [torch.ones_like(p) for p in params]
    for p, g in zip(params, grads):
        p.grad = g
    with pytest.raises(RuntimeError, match="a later hook failed"):
        optimizer.step()
    handle.remove()
    probe.collect(3)
    before = [p.detach().clone() for p in params]
    optimizer.step()  # the copies the failed step left are not diffed against this one
    moved = float((params[2].detach() - before[2]).abs().sum())
    assert probe.collect(4).l1["c"] == pytest.approx(moved, rel=1e-6)
    assert all(p.grad is g for p, g in zip(params, grads))


def test_a_second_probe_on_an_optimizer_takes_the_first_ones_place():
    params = masters()
    optimizer = adamw(params)
    first = StepHookProbe(layout(optimizer, params))
    second = StepHookProbe(layout(optimizer, params), fused=True)
    train(optimizer, params, steps=1)
    assert first.collect(1).l1 == dict.fromkeys("abc", 0.0)
    assert second.collect(1).l1["a"] > 0


def test_a_failed_fused_step_gives_the_gradients_back(monkeypatch):
    from layercheck.workers.drift import fused as drift_fused

    params = masters()
    optimizer = adamw(params)
    StepHookProbe(layout(optimizer, params), fused=True)
    calls = []

    def fails_second(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("out of memory")
        return real(*args, **kwargs)

    real = drift_fused.adamw_l1_torch_slots
    monkeypatch.setattr(drift_fused, "adamw_l1_torch_slots", fails_second)
    grads = [torch.ones_like(p) for p in params]
    for p, g in zip(params, grads):
        p.grad = g
    with pytest.raises(RuntimeError, match="out of memory"):
        optimizer.step()
    assert all(p.grad is g for p, g in zip(params, grads))


@pytest.mark.parametrize(
    "make, reason",
    [
        (lambda ps: torch.optim.AdamW(ps, fused=True), "fused=True"),
        (lambda ps: torch.optim.AdamW(ps, amsgrad=True), "amsgrad=True"),
        (lambda ps: torch.optim.Adam(ps, weight_decay=0.1), "L2 weight decay"),
        (lambda ps: torch.optim.SGD(ps, lr=0.1), "is not torch's AdamW or Adam"),
        (lambda ps: torch.optim.AdamW(ps, lr=torch.tensor(0.01)), "a tensor hyper-parameter (lr)"),
        (lambda ps: torch.optim.AdamW([p.detach().bfloat16().requires_grad_() for p in ps]), "torch.bfloat16"),
        (lambda ps: torch.optim.AdamW([torch.nn.Parameter(torch.ones(3, 4).t())]), "not dense, contiguous fp32"),
        (lambda ps: torch.optim.AdamW(ps, betas=(torch.tensor(0.9), torch.tensor(0.99))), "tensor hyper-parameter"),
    ],
)
def test_what_the_fused_step_cannot_replace_it_says_and_refuses(make, reason):
    params = masters()
    optimizer = make(params)
    assert reason in fused_refusal(optimizer)
    with pytest.raises(ValueError, match="drift_probe='fused' cannot step this optimizer in its place"):
        StepHookProbe(layout(optimizer, params), fused=True)
    assert fused_refusal(torch.optim.Adam(params)) is None  # Adam without weight decay is AdamW's update


def test_a_fused_step_collected_as_unmeasured_is_not_read_against_an_own_step():
    """The fused step ran (armed for step 4) but the loop collected step 5, which the schedule does
    not measure: its time is the probe's, nothing is subtracted for it, and no own step is timed."""
    params = masters()
    optimizer = adamw(params)
    probe = StepHookProbe(layout(optimizer, params), every=3, fused=True)
    probe.schedule.arm_after(3)
    for step in (5, 6):
        for p in params:
            p.grad = torch.ones_like(p)
        optimizer.step()
        cost = probe.collect(step).cost
        assert not cost.measured and not cost.replaced and cost.own_steps == 0, (step, cost)
