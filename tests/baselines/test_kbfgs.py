"""K-BFGS: damped BFGS algebra, positive definiteness, convergence on a convex quadratic."""
from __future__ import annotations


import pytest
import torch
import torch.nn as nn

import tengrad_fx
from tengrad_fx.optim.baselines.kbfgs import KBFGS, damped_bfgs_update

from ._helpers import batch, cnn, prepared, rel


def _spd(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    M = torch.randn(n, n, generator=g, dtype=torch.float64)
    return M @ M.T / n + 0.1 * torch.eye(n, dtype=torch.float64)


def test_secant_equation_for_the_damped_pair():
    g = torch.Generator().manual_seed(0)
    for seed in range(5):
        H = _spd(6, seed)
        s, y = torch.randn(2, 6, generator=g, dtype=torch.float64)
        for lm in (0.0, 0.3):
            Hn, st, yt = damped_bfgs_update(H, s, y, powell=0.2, lm=lm)
            assert rel(Hn @ yt, st) < 1e-12
            assert torch.allclose(Hn, Hn.T)
            if (s @ y) >= 0.2 * (y @ H @ y):  # undamped by Powell: the raw s is kept
                assert torch.equal(st, s) and rel(yt, y + lm * s) < 1e-15


def test_powell_damping_keeps_inverse_positive_definite():
    g = torch.Generator().manual_seed(1)
    H = torch.eye(5, dtype=torch.float64).expand(3, 5, 5).clone()  # batched over 3 groups
    for _ in range(60):
        s = torch.randn(3, 5, generator=g, dtype=torch.float64)
        y = (-s * torch.rand(3, 1, generator=g, dtype=torch.float64)
             + 0.01 * torch.randn(3, 5, generator=g, dtype=torch.float64))
        assert bool(((s * y).sum(-1) < 0).all())  # adversarial: negative curvature pairs
        Hy = (H @ y.unsqueeze(-1)).squeeze(-1)
        Hn, st, yt = damped_bfgs_update(H, s, y, powell=0.2, lm=0.0)
        # Powell: s̃ᵀy = μ₁ yᵀHy > 0 exactly
        assert torch.allclose((st * y).sum(-1), 0.2 * (y * Hy).sum(-1), rtol=1e-9)
        assert rel((Hn @ yt.unsqueeze(-1)).squeeze(-1), st) < 1e-9
        H = Hn
        assert bool((torch.linalg.eigvalsh(H) > 0).all())


def test_degenerate_pair_keeps_H():
    H = _spd(4, 3)
    z = torch.zeros(4, dtype=torch.float64)
    Hn, _, _ = damped_bfgs_update(H, z, z, lm=0.1)
    assert torch.equal(Hn, H)


def _least_squares():
    torch.manual_seed(0)
    X = torch.randn(64, 5, dtype=torch.float64)
    T = X @ torch.randn(5, 3, dtype=torch.float64) + 0.1 * torch.randn(64, 3, dtype=torch.float64)
    net = nn.Sequential(nn.Linear(5, 3)).double()
    model = tengrad_fx.prepare(net, example_inputs=(X[:2],))

    def loss_fn():
        return 0.5 * (model(X) - T).pow(2).sum(1).mean()

    Xt = torch.cat([X, torch.ones(64, 1, dtype=torch.float64)], 1)
    best = 0.5 * (Xt @ torch.linalg.lstsq(Xt, T).solution - T).pow(2).sum(1).mean().item()
    return model, loss_fn, best


@pytest.mark.parametrize("secant", ["consecutive", "same_batch"])
def test_converges_on_convex_quadratic(secant):
    model, loss_fn, best = _least_squares()
    opt = KBFGS(model, lr=0.5, damping=1e-6, momentum=0.0, stat_decay=0.0, curvature_every=1, inverse_every=1,
                secant=secant)

    def closure():
        opt.zero_grad()
        loss = loss_fn()
        loss.backward()
        return loss

    first = loss_fn().item()
    for _ in range(40):
        if secant == "same_batch":
            opt.step(closure)
        else:
            closure()
            opt.step()
    final = loss_fn().item()
    assert final - best < 1e-8 * max(1.0, first - best), (first, final, best)
    assert opt.pairs > 0
    H = opt.HG[0]
    assert bool((torch.linalg.eigvalsh(H) > 0).all())


def test_same_batch_requires_closure_and_conv_runs():
    net = cnn()
    x, y = batch(6, seed=7)
    _, model = prepared(net, x)
    opt = KBFGS(model, lr=0.05, curvature_every=1, secant="same_batch")
    model.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    with pytest.raises(RuntimeError, match="closure"):
        opt.step()

    def closure():
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        return loss

    losses = [opt.step(closure).item() for _ in range(8)]
    assert losses[-1] < losses[0]
    assert opt.pairs > 0
    for i, H in opt.HG.items():
        assert H.shape == (opt.blocks[i].g, opt.blocks[i].o, opt.blocks[i].o)
        assert bool((torch.linalg.eigvalsh(H) > 0).all())
