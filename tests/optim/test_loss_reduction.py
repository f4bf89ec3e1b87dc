"""A loss whose batch reduction does not match ``prepare(..., loss_reduction=...)`` is an
error on the first curvature step; a loss scaled by a constant warns once
(:mod:`tengrad_fx.optim.step.reduction_check`)."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import tengrad_fx
from tengrad_fx import TENGraD
from tengrad_fx.optim.baselines.kfac import KFAC


def _setup(reduction: str, cls: type = TENGraD, **kw):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(1, 3, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(3 * 5 * 5, 6),
                        nn.Tanh(), nn.Linear(6, 4))
    model = tengrad_fx.prepare(net, example_inputs=(torch.randn(2, 1, 5, 5),), loss_reduction=reduction)
    return model, cls(model, lr=0.05, damping=0.1, **kw)


def _batch(seed: int = 0, m: int = 8):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(m, 1, 5, 5, generator=g), torch.randint(0, 4, (m,), generator=g)


def _step(model, opt, loss_fn, seed: int = 0) -> None:
    x, y = _batch(seed)
    opt.zero_grad()
    loss_fn(model(x), y).backward()
    opt.step()


@pytest.mark.parametrize("cls", [TENGraD, KFAC])
@pytest.mark.parametrize("prepared, used", [("mean", "sum"), ("sum", "mean")])
def test_mismatched_reduction_is_an_error(cls: type, prepared: str, used: str) -> None:
    model, opt = _setup(prepared, cls)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match=rf"reduced by '{used}'.*prepared with loss_reduction='{prepared}'"
                                           rf".*64.*Fix: tengrad_fx.prepare\(model, loss_reduction='{used}'\)"):
        _step(model, opt, lambda out, y: F.cross_entropy(out, y, reduction=used))
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))  # nothing applied


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_matching_reduction_is_silent(reduction: str) -> None:
    model, opt = _setup(reduction, curvature_every=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for t in range(3):
            _step(model, opt, lambda out, y: F.cross_entropy(out, y, reduction=reduction), seed=t)


def test_constant_scaled_loss_warns_once() -> None:
    model, opt = _setup("mean")
    with pytest.warns(RuntimeWarning, match=r"multiplied by 0.5.*damping/0.25"):
        _step(model, opt, lambda out, y: 0.5 * F.cross_entropy(out, y))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _step(model, opt, lambda out, y: 0.5 * F.cross_entropy(out, y), seed=1)
    assert opt.counters["step"] == 2


@pytest.mark.parametrize("loss", ["mse", "label_smoothing"])
def test_losses_it_cannot_identify_are_not_judged(loss: str) -> None:
    """Only a hard-label cross-entropy on a covered head identifies the scale; for other
    losses nothing is said, even with a mismatched reduction (documented limit)."""
    model, opt = _setup("mean")
    fn = ((lambda out, y: F.mse_loss(out, F.one_hot(y, 4).float(), reduction="sum")) if loss == "mse" else
          (lambda out, y: F.cross_entropy(out, y, reduction="sum", label_smoothing=0.1)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _step(model, opt, fn)
