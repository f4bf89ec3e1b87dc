"""The fused update (eager and torch.compile-d) and a compiled training loop equal eager."""
from __future__ import annotations


import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import tengrad_fx
from tengrad_fx.optim.tengrad.fused_update import fused_update


def _cnn() -> nn.Module:
    torch.manual_seed(0)
    # two convs of equal shape -> their J stack into one vmap group
    return nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 4, 3, padding=1), nn.ReLU(),
        nn.Conv2d(4, 4, 3, padding=1), nn.Flatten(), nn.Linear(4 * 6 * 6, 12), nn.ReLU(),
        nn.Linear(12, 5, bias=False),
    ).double()


def _train(model: nn.Module, steps: int, **kw) -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, 1, 6, 6, generator=g, dtype=torch.float64)
    y = torch.randint(0, 5, (6,), generator=g)
    pm = tengrad_fx.prepare(model, example_inputs=(x[:2],))
    fused_fn = kw.pop("fused_fn", "keep")
    kw = {"curvature_every": 1, "kl_clip": None, **kw}
    opt = tengrad_fx.TENGraD(pm, lr=0.2, damping=0.05, weight_decay=1e-3, **kw)
    if fused_fn is None:
        opt._fused.fn = None  # fused function, run eagerly
    for it in range(steps):
        opt.zero_grad()
        F.cross_entropy(pm(x + 0.05 * it), y).backward()
        opt.step()
    return torch.cat([p.detach().flatten() for p in pm.parameters()])


@pytest.mark.parametrize("T", [1, 3])
def test_fused_eager_equals_modular(T: int) -> None:
    ref = _train(_cnn(), 4, curvature_every=T)
    got = _train(_cnn(), 4, curvature_every=T, compile=True, fused_fn=None)
    assert (ref - got).abs().max().item() < 1e-12
    assert (ref - _train(_cnn(), 0)).abs().max().item() > 1e-3  # the steps did move


def test_fused_update_push_through_equals_woodbury() -> None:
    torch.manual_seed(1)
    m = 5
    Jw, Jb = torch.randn(m, 7, dtype=torch.float64), torch.randn(m, 2, dtype=torch.float64)
    A, B = torch.randn(m, 3, dtype=torch.float64), torch.randn(m, 4, dtype=torch.float64)
    layers = [("J", Jw, Jb), ("J", Jw * 2, Jb), ("IG", A, B, True)]
    J3 = torch.cat([(B[:, :, None] * A[:, None, :]).flatten(1), B], 1)
    grads = [torch.cat([Jw, Jb], 1).sum(0) / m, torch.cat([Jw * 2, Jb], 1).sum(0) / m, J3.sum(0) / m]
    alpha = 0.3
    pt, ok = fused_update(layers, grads, m * alpha, 1.0, alpha, True)
    wb, _ = fused_update(layers, grads, m * alpha, 1.0, alpha, False)
    assert ok.all()
    for (u1, u2, g, J) in zip(pt, wb, grads, [torch.cat([Jw, Jb], 1), torch.cat([Jw * 2, Jb], 1), J3]):
        dense = torch.linalg.solve(J.T @ J / m + alpha * torch.eye(J.shape[1], dtype=torch.float64), g)
        assert torch.allclose(u1, dense, rtol=1e-10, atol=1e-12)
        assert torch.allclose(u2, dense, rtol=1e-10, atol=1e-12)


def test_compiled_update_equals_eager() -> None:
    ref = _train(_cnn(), 3)
    got = _train(_cnn(), 3, compile="aot_eager")
    assert (ref - got).abs().max().item() < 1e-10


@pytest.mark.slow
def test_compiled_update_inductor_equals_eager() -> None:
    ref = _train(_cnn(), 3)
    got = _train(_cnn(), 3, compile=True)
    assert (ref - got).abs().max().item() < 1e-8


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def test_compiled_training_loop_equals_eager() -> None:
    """torch.compile(prepared, fullgraph=True) + TENGraD gives eager's parameters."""
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(8, 6, generator=g) for _ in range(3)]
    ys = [torch.randint(0, 3, (8,), generator=g) for _ in range(3)]
    params = []
    for compiled in (False, True):
        pm = tengrad_fx.prepare(_mlp(), example_inputs=(xs[0][:2],))
        fwd = torch.compile(pm, fullgraph=True) if compiled else pm
        opt = tengrad_fx.TENGraD(pm, lr=0.1, damping=0.1, curvature_every=1, kl_clip=None)
        for x, y in zip(xs, ys):
            opt.zero_grad()
            F.cross_entropy(fwd(x), y).backward()
            opt.step()
        assert tengrad_fx.get_info(pm).store.records, "compiled model did not capture"
        params.append(torch.cat([p.detach().flatten() for p in pm.parameters()]))
    assert (params[0] - params[1]).abs().max().item() <= 1e-5


def test_prepared_model_has_no_graph_breaks() -> None:
    pm = tengrad_fx.prepare(_mlp(), example_inputs=(torch.randn(2, 6),))
    expl = torch._dynamo.explain(pm)(torch.randn(4, 6))
    assert expl.graph_break_count == 0 and expl.graph_count == 1
