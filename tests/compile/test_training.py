"""Training a compiled prepared model gives eager's steps: empirical and MC Fisher,
curvature every step and every third, with the optimizer's own compiled update on top."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import tengrad_fx


def _cnn(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
        nn.Conv2d(4, 4, 3, padding=1), nn.ReLU(inplace=True),
        nn.MaxPool2d(2), nn.Flatten(), nn.Linear(4 * 3 * 3, 12), nn.ReLU(), nn.Linear(12, 5),
    ).to(dtype)


def _train(model: nn.Module, compiled: bool, steps: int, dtype: torch.dtype, **kw) -> tuple[list[float], torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(8, 1, 6, 6, generator=g, dtype=dtype) for _ in range(steps)]
    ys = [torch.randint(0, 5, (8,), generator=g) for _ in range(steps)]
    pm = tengrad_fx.prepare(model, example_inputs=(xs[0][:2],))
    fwd = torch.compile(pm) if compiled else pm
    opt = tengrad_fx.TENGraD(pm, lr=0.1, damping=0.05, weight_decay=1e-3, **kw)
    losses = []
    for i, (x, y) in enumerate(zip(xs, ys)):
        torch.manual_seed(100 + i)  # the MC draw
        opt.zero_grad()
        out = fwd(x)
        opt.mc_capture(out)  # no-op for the empirical Fisher and on reuse steps
        loss = F.cross_entropy(out, y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, torch.cat([p.detach().flatten() for p in pm.parameters()])


@pytest.mark.parametrize("T", [1, 3])
def test_compiled_model_trains_as_eager_float64(T: int) -> None:
    kw = dict(curvature_every=T, fisher="empirical", kl_clip=None)
    ref = _train(_cnn(torch.float64), False, 6, torch.float64, **kw)
    got = _train(_cnn(torch.float64), True, 6, torch.float64, **kw)
    assert max(abs(a - b) for a, b in zip(ref[0], got[0])) <= 1e-12
    assert (ref[1] - got[1]).abs().max().item() <= 1e-10
    start = torch.cat([p.detach().flatten() for p in _cnn(torch.float64).parameters()])
    assert (ref[1] - start).abs().max().item() > 1e-3  # the steps did move


def test_compiled_model_mc_fisher_and_compiled_update_float32() -> None:
    """The paper's setting (MC Fisher, KL clip) on a compiled model, with ``compile=True``:
    float32 rounding of eager's losses and parameters."""
    kw = dict(curvature_every=3, fisher="mc", kl_clip=0.01)
    ref = _train(_cnn(torch.float32), False, 6, torch.float32, **kw)
    got = _train(_cnn(torch.float32), True, 6, torch.float32, compile=True, **kw)
    assert max(abs(a - b) / abs(a) for a, b in zip(ref[0], got[0])) <= 1e-5
    assert ((ref[1] - got[1]).norm() / ref[1].norm()).item() <= 1e-5
