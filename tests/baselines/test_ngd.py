"""Dense block NGD against ``solve(F + αI, g)`` from ``testing.per_sample_grads_reference``,
and TENGraD's update against NGD's (float64)."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import tengrad_fx
from testing import explicit_jacobian, per_sample_grads_reference
from tengrad_fx import TENGraD
from tengrad_fx.optim.baselines.ngd import NGD

from ._helpers import batch, cnn, prepared, rel, snapshot, step_delta

ALPHA = 0.05


def _layers(model):
    out = {}
    for pn, layer in sorted(tengrad_fx.get_info(model).covered.items(), key=lambda kv: not kv[0].endswith("weight")):
        out.setdefault(layer, []).append(pn)
    return out


def test_ngd_equals_dense_solve():
    net = cnn(bias2=False)
    x, y = batch(7, seed=11)
    template, model = prepared(net, x)
    opt = NGD(model, lr=1.0, damping=ALPHA, momentum=0.0)
    ref = snapshot(template, model)
    model.zero_grad()
    F.cross_entropy(model(x), y).backward()
    g = {n: p.grad.clone() for n, p in model.named_parameters()}
    psg = per_sample_grads_reference(ref, x, F.cross_entropy, y)
    u = step_delta(model, opt)
    for _, names in _layers(model).items():
        J = explicit_jacobian(psg, names[0], names[1] if len(names) > 1 else None)
        m, n = J.shape
        gv = torch.cat([g[k].flatten() for k in names])
        want = torch.linalg.solve(J.T @ J / m + ALPHA * torch.eye(n, dtype=J.dtype), gv)
        got = torch.cat([u[k].flatten() for k in names])
        assert rel(got, want) < 1e-10, names


@pytest.mark.parametrize("m", [5, 40])  # m < n and m > n for some layers
def test_tengrad_step_equals_ngd_step(m):
    x, y = batch(m, seed=12)
    deltas = []
    for cls in (NGD, TENGraD):
        net = cnn()
        _, model = prepared(net, x)
        opt = cls(model, lr=1.0, damping=ALPHA, momentum=0.0, weight_decay=0.0, curvature_every=1, kl_clip=None)
        model.zero_grad()
        F.cross_entropy(model(x), y).backward()
        deltas.append(step_delta(model, opt))
    for name in deltas[0]:
        scale = max(1.0, deltas[0][name].abs().max().item())
        assert (deltas[0][name] - deltas[1][name]).abs().max().item() <= 1e-8 * scale, name
        assert rel(deltas[1][name], deltas[0][name]) < 1e-8, name


def test_refuses_large_layers_naming_layer_and_size():
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 300), nn.ReLU(), nn.Linear(300, 80))
    model = tengrad_fx.prepare(net, example_inputs=(torch.randn(2, 4),))
    with pytest.raises(ValueError, match=r"max_params.*'4'.*24080"):
        NGD(model, lr=0.1, damping=0.1)
    NGD(model, lr=0.1, damping=0.1, max_params=24080)  # at the limit: accepted


def test_mc_fisher_and_reuse():
    net = cnn()
    x, y = batch(8, seed=13)
    _, model = prepared(net, x)
    opt = NGD(model, lr=0.1, damping=0.1, fisher="mc", curvature_every=2)
    store = tengrad_fx.get_info(model).store
    for _it in range(4):
        model.zero_grad()
        out = model(x)
        loss = F.cross_entropy(out, y)
        opt.mc_capture(out)
        loss.backward()
        opt.step()
    assert store.generation == 2  # statistics on steps 0 and 2 only
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_reused_fisher_with_new_damping():
    """Between curvature steps F is reused (capture off); a damping change refactorizes."""
    net = cnn(bias2=False)
    x0, y0 = batch(6, seed=21)
    x1, y1 = batch(6, seed=22)
    template, model = prepared(net, x0)
    opt = NGD(model, lr=1.0, damping=ALPHA, momentum=0.0, curvature_every=3)
    ref0 = snapshot(template, model)
    psg = per_sample_grads_reference(ref0, x0, F.cross_entropy, y0)
    model.zero_grad()
    F.cross_entropy(model(x0), y0).backward()
    opt.step()
    opt.param_groups[0]["damping"] = 0.2
    model.zero_grad()
    F.cross_entropy(model(x1), y1).backward()
    g = {n: p.grad.clone() for n, p in model.named_parameters()}
    u = step_delta(model, opt)
    for _, names in _layers(model).items():
        J = explicit_jacobian(psg, names[0], names[1] if len(names) > 1 else None)
        m, n = J.shape
        want = torch.linalg.solve(J.T @ J / m + 0.2 * torch.eye(n, dtype=J.dtype),
                                  torch.cat([g[k].flatten() for k in names]))
        assert rel(torch.cat([u[k].flatten() for k in names]), want) < 1e-10, names
