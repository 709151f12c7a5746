"""DriftAdamW: the same updates as torch's AdamW, and the L1 of each update it applies."""

from __future__ import annotations

import pytest
import torch

from layercheck.workers.drift.adamw import DriftAdamW


def _pair(seed: int = 0, **torch_kind):
    """DriftAdamW and torch's AdamW (``torch_kind``: e.g. ``fused=True``) on equal parameters."""
    torch.manual_seed(seed)
    ours = [torch.randn(6, 5, requires_grad=True), torch.randn(11, requires_grad=True)]
    ref = [t.detach().clone().requires_grad_(True) for t in ours]
    kwargs = {"lr": 1e-2, "betas": (0.8, 0.95), "eps": 1e-7}
    a = DriftAdamW(
        [
            {"params": [ours[0]], "weight_decay": 0.1, "name": "w"},
            {"params": [ours[1]], "weight_decay": 0.0, "name": "b"},
        ],
        **kwargs,
    )
    b = torch.optim.AdamW(
        [{"params": [ref[0]], "weight_decay": 0.1}, {"params": [ref[1]], "weight_decay": 0.0}], **kwargs, **torch_kind
    )
    return ours, ref, a, b


def _step(params, optimizer, grads):
    for p, g in zip(params, grads):
        p.grad = g.clone()
    optimizer.step()


def test_matches_torch_adamw_and_reports_l1_of_the_update():
    ours, ref, a, b = _pair()
    for _ in range(6):
        grads = [torch.randn_like(p) for p in ours]
        before = [p.detach().clone() for p in ours]
        _step(ours, a, grads)
        _step(ref, b, grads)
        drift = a.take_drift()
        for p, q in zip(ours, ref):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7)
        assert drift["w"].item() == pytest.approx((ours[0] - before[0]).abs().sum().item(), rel=1e-5)
        assert drift["b"].item() == pytest.approx((ours[1] - before[1]).abs().sum().item(), rel=1e-5)
    for key in ("exp_avg", "exp_avg_sq", "step"):
        torch.testing.assert_close(a.state[ours[0]][key], b.state[ref[0]][key])


def test_every_step_is_torchs_fused_adamw_bit_for_bit_whichever_steps_are_measured():
    """Measured or not (the steps a sampled probe skips), a step is torch's own AdamW (fused on
    CPU): the trajectory does not depend on the drift schedule; a measured step also counts the
    L1 of what it moved, an unmeasured one nothing."""
    ours, ref, a, fused = _pair(fused=True)
    for i in range(7):
        a.measuring = i % 3 == 1
        grads = [torch.randn_like(p) for p in ours]
        before = [p.detach().clone() for p in ours]
        _step(ours, a, grads)
        _step(ref, fused, grads)
        drift = a.take_drift()
        for p, q in zip(ours, ref):
            assert torch.equal(p, q)
            for key in ("exp_avg", "exp_avg_sq", "step"):
                assert torch.equal(a.state[p][key], fused.state[q][key]), key
        if not a.measuring:
            assert drift == {}
            continue
        for name, p, b in zip(("w", "b"), ours, before):
            assert drift[name].item() == pytest.approx((p - b).abs().sum().item(), rel=1e-6)


def test_drift_accumulates_until_taken_and_honours_windows():
    ours, _, a, _ = _pair()
    a.set_drift_windows(ours[0], [(0, 4), (10, 3)])
    a.set_drift_windows(ours[1], [])  # a tensor with no owned elements reports nothing
    per_step = []
    for _ in range(2):
        before = ours[0].detach().clone().view(-1)
        _step(ours, a, [torch.randn_like(p) for p in ours])
        diff = (ours[0].detach().view(-1) - before).abs()
        per_step.append((diff[0:4].sum() + diff[10:13].sum()).item())
    drift = a.take_drift()
    assert set(drift) == {"w"}
    assert drift["w"].item() == pytest.approx(sum(per_step), rel=1e-5)
    assert a.take_drift() == {}


def test_bad_windows_and_duplicate_names_are_rejected():
    ours, _, a, _ = _pair()
    with pytest.raises(ValueError, match="outside"):
        a.set_drift_windows(ours[1], [(8, 5)])
    with pytest.raises(ValueError, match="duplicate"):
        DriftAdamW([{"params": [ours[0]], "name": "x"}, {"params": [ours[1]], "name": "x"}])
    unnamed = DriftAdamW([{"params": [ours[0]]}, {"params": [ours[1]]}])
    assert [g["name"] for g in unnamed.param_groups] == ["group.0", "group.1"]


def test_init_state_creates_step_zero_and_zero_moments_once():
    ours, _, a, _ = _pair()
    state = a.init_state(ours[0])
    assert state["step"].item() == 0 and not state["exp_avg"].any() and not state["exp_avg_sq"].any()
    state["exp_avg"].fill_(1.0)
    assert a.init_state(ours[0])["exp_avg"].eq(1.0).all()


def test_the_step_after_a_fused_one_is_timed_on_its_own_clock_and_changes_nothing():
    """What the summary reads a fused step against: torch's AdamW step on the unmeasured step after
    a measured fused one (``own_step``, settled by the probe after each step), timed on its own
    clock and the same step bit for bit as the untimed one."""
    ours, _, timed_opt, _ = _pair()
    _, _, twin, _ = _pair()
    twin_params = [p for group in twin.param_groups for p in group["params"]]
    for optimizer in (timed_opt, twin):
        optimizer.drift_step = "fused"
    for i in range(4):
        timed_opt.measuring = twin.measuring = i == 0
        grads = [torch.randn_like(p) for p in ours]
        _step(ours, timed_opt, grads)
        _step(twin_params, twin, grads)
        assert all(torch.equal(p, q) for p, q in zip(ours, twin_params)), i
        replaced, seconds, timed = timed_opt.own_step.settle(measured=i == 0, next_measured=False)
        assert replaced == (i == 0) and (seconds > 0) == (i == 1) and timed == (i == 1), i
    assert twin.own_step.clock.take() == 0.0  # never settled: never due
    assert timed_opt.probe_clock.take() > 0  # the fused step's own work, on the other clock
