"""Every method trains a small CNN on real Fashion-MNIST, and runs on a timm model."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import tengrad_fx
from tengrad_fx.optim.registry import PAPER_DEFAULTS, make_optimizer

from ._helpers import need_fmnist

METHODS = ["tengrad", "kfac", "ekfac", "kbfgs", "ngd", "sgd"]
# statistics every few steps so a few dozen steps exercise every schedule
FAST = {"kfac": dict(curvature_every=5, inverse_every=10),
        "ekfac": dict(curvature_every=5, rescale_every=5, inverse_every=10),
        "kbfgs": dict(curvature_every=5, inverse_every=10), "ngd": dict(curvature_every=3),
        "tengrad": dict(curvature_every=3)}


def small_cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 8, 5, stride=2), nn.ReLU(), nn.MaxPool2d(2),        # 8 x 6 x 6
        nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),      # 16 x 3 x 3
        nn.Flatten(), nn.Linear(144, 10),
    )


@pytest.mark.parametrize("name", METHODS)
def test_trains_small_cnn_on_fashion_mnist(name):
    X, Y = need_fmnist()
    model = tengrad_fx.prepare(small_cnn(), example_inputs=(X[:2],))
    hp = dict(PAPER_DEFAULTS.get(name, PAPER_DEFAULTS["tengrad"])["fashion-mnist"]["3c1f"], momentum=0.9)
    hp.update(FAST.get(name, {}))
    opt = make_optimizer(name, model, **hp)
    Xe, Ye = X[:256], Y[:256]
    with torch.no_grad():
        before = F.cross_entropy(model(Xe), Ye).item()
    g = torch.Generator().manual_seed(0)
    for _ in range(30):
        idx = torch.randint(0, X.shape[0], (64,), generator=g)
        loss = F.cross_entropy(model(X[idx]), Y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        after = F.cross_entropy(model(Xe), Ye).item()
    assert after < 0.85 * before, (name, before, after)
    if hasattr(opt, "counters"):
        assert opt.counters == {"step": 30, "skipped": 0, "uncaptured": 0}


def test_kfac_mc_fisher_trains():
    X, Y = need_fmnist()
    model = tengrad_fx.prepare(small_cnn(), example_inputs=(X[:2],))
    opt = make_optimizer("kfac", model, dataset="fashion-mnist", fisher="mc", curvature_every=5, inverse_every=10)
    with torch.no_grad():
        before = F.cross_entropy(model(X[:256]), Y[:256]).item()
    for it in range(20):
        xb, yb = X[64 * it: 64 * (it + 1)], Y[64 * it: 64 * (it + 1)]
        out = model(xb)
        loss = F.cross_entropy(out, yb)
        opt.zero_grad()
        opt.mc_capture(out)
        loss.backward()
        opt.step()
    with torch.no_grad():
        assert F.cross_entropy(model(X[:256]), Y[:256]).item() < 0.9 * before


@pytest.fixture(scope="module")
def timm_model():
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    net = timm.create_model("test_convnext", num_classes=10, pretrained=False)  # depthwise convs, channels-last Linear
    x = torch.randn(4, 3, 32, 32)
    model = tengrad_fx.prepare(net, example_inputs=(x[:2],))
    return model, {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("name", METHODS)
def test_runs_on_timm_model(name, timm_model):
    model, state = timm_model
    model.load_state_dict(state)
    for p in model.parameters():
        p.requires_grad_(True)
    if name == "ngd":  # dense blocks: only layers up to 4000 parameters stay trainable
        for layer in tengrad_fx.covered_layers(model):
            ps = [p for p in (layer.weight, layer.bias) if p is not None]
            if sum(p.numel() for p in ps) > 4000:
                for p in ps:
                    p.requires_grad_(False)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(4, 3, 32, 32, generator=g), torch.randint(0, 10, (4,), generator=g)
    opt = make_optimizer(name, model, lr=0.01, damping=0.1,
                         **({"curvature_every": 1} if name in FAST and "curvature_every" in FAST[name] else {}))
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no skipped step
        for _ in range(2):
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())
    moved = [n for n, p in model.named_parameters() if p.requires_grad and not torch.equal(p.detach(), state[n])]
    assert moved
    # depthwise convs are covered (one Kronecker pair per channel for the K-FAC family)
    if name in ("kfac", "ekfac", "kbfgs"):
        assert any(b.g > 1 and b.o == 1 for b in opt.blocks)
