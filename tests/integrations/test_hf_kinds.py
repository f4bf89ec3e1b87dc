"""Unit tests of the two Hugging Face layer kinds on hand-written models (float64):
``Conv1D`` as a transposed Linear (fx and surgery paths, TENGraD's strategies, the
K-FAC family's matrix form) and the structural RMSNorm matcher (:mod:`tengrad_fx.capture.rms_probe`)."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import tengrad_fx
from tengrad_fx import get_info, prepare
from tengrad_fx.capture.match import match_module
from testing.oracle import check_covered_layers, check_tengrad_step

pytorch_utils = pytest.importorskip("transformers.pytorch_utils")
Conv1D = pytorch_utils.Conv1D


class Net(nn.Module):
    """``[m, S, 4] -> [m, 3]``; ``untraceable``: a ``len()`` torch.fx cannot trace (surgery path)."""

    def __init__(self, first: nn.Module, mid: nn.Module, last: nn.Module, untraceable: bool):
        super().__init__()
        self.a, self.n, self.b, self.untraceable = first, mid, last, untraceable

    def forward(self, x):
        h = self.n(torch.tanh(self.a(x)))
        if self.untraceable:
            h = h[: len(h)]
        return self.b(h).sum(1)


def _data(seed=0, m=5):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(m, 7, 4, generator=g, dtype=torch.float64), torch.randint(0, 3, (m,), generator=g)


def _conv1d_net(untraceable):
    torch.manual_seed(0)
    return Net(Conv1D(6, 4), nn.Identity(), Conv1D(3, 6), untraceable).double()


@pytest.mark.parametrize("untraceable", [False, True])
def test_conv1d_exact(untraceable):
    net = _conv1d_net(untraceable)
    orig = copy.deepcopy(net)
    x, y = _data()
    pm = prepare(net, example_inputs=(x[:2],))
    info = get_info(pm)
    assert info.method == ("surgery" if untraceable else "fx")
    assert set(info.covered) == {"a.weight", "a.bias", "b.weight", "b.bias"}
    assert [s.transposed for s in info.layers] == [True, True]
    check_covered_layers(orig, pm, x, y)


@pytest.mark.parametrize("untraceable", [False, True])
@pytest.mark.parametrize("strategy", ["factor", "materialize", "auto"])
def test_conv1d_tengrad_step(untraceable, strategy):
    net = _conv1d_net(untraceable)
    orig = copy.deepcopy(net)
    x, y = _data(1)
    pm = prepare(net, example_inputs=(x[:2],))
    opt = tengrad_fx.TENGraD(pm, lr=1.0, damping=0.07, momentum=0.0, strategy=strategy, curvature_every=1,
                             kl_clip=None)
    check_tengrad_step(pm, opt, orig, x, y, 0.07)


def test_conv1d_fused_single_position():
    """One position per sample (``[m, d]`` inputs): the fused update takes Conv1D's ``J`` in
    its ``[d_in, d_out]`` layout (the factored ``IG`` form is for ``[d_out, d_in]`` weights)."""
    torch.manual_seed(0)
    net = nn.Sequential(Conv1D(6, 4), nn.Tanh(), Conv1D(3, 6)).double()
    orig = copy.deepcopy(net)
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(6, 4, generator=g, dtype=torch.float64), torch.randint(0, 3, (6,), generator=g)
    pm = prepare(net, example_inputs=(x[:2],))
    opt = tengrad_fx.TENGraD(pm, lr=1.0, damping=0.05, momentum=0.0, strategy="factor", curvature_every=1,
                             kl_clip=None, compile=True)
    opt._fused.fn = None  # the fused function, eagerly
    check_tengrad_step(pm, opt, orig, x, y, 0.05)


@pytest.mark.parametrize("method", ["KFAC", "EKFAC", "KBFGS"])
def test_conv1d_kronecker_baselines_match_linear(method):
    """The K-FAC family on Conv1D layers gives the transpose of its update on the same
    layers as ``nn.Linear`` (weights transposed)."""
    conv = _conv1d_net(False)
    lin = Net(nn.Linear(4, 6), nn.Identity(), nn.Linear(6, 3), False).double()
    with torch.no_grad():
        for c, l in ((conv.a, lin.a), (conv.b, lin.b)):
            l.weight.copy_(c.weight.t())
            l.bias.copy_(c.bias)
    x, y = _data(3)
    deltas = []
    for net in (conv, lin):
        pm = prepare(net, example_inputs=(x[:2],))
        opt = getattr(tengrad_fx, method)(pm, lr=1.0, damping=0.1, momentum=0.0, kl_clip=None, curvature_every=1,
                                          inverse_every=1)
        before = {n: p.detach().clone() for n, p in pm.named_parameters()}
        F.cross_entropy(pm(x), y).backward()
        opt.step()
        deltas.append({n: before[n] - p.detach() for n, p in pm.named_parameters()})
    for n, d in deltas[1].items():
        got = deltas[0][n].t() if n.endswith("weight") else deltas[0][n]
        assert d.abs().max() > 0
        assert torch.allclose(got, d, rtol=1e-10, atol=1e-14), n


# --------------------------------------------------------------------------- RMSNorm-shaped modules
class PlainRMS(nn.Module):
    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d))
        self.eps = eps

    def forward(self, x):
        return self.weight * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + self.eps))


class OnePlusRMS(nn.Module):
    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d))
        self.epsilon = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.epsilon) * (1 + self.weight)


class UpcastRMS(nn.Module):
    """Llama's computation: statistics and ``x̂`` in float32, cast back, then ``γ ⊙ x̂``."""

    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d))
        self.variance_epsilon = eps

    def forward(self, x):
        dt = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * h.to(dt)


class CentredRMS(PlainRMS):
    """A near miss: mean-centred (LayerNorm without bias)."""

    def forward(self, x):
        x = x - x.mean(-1, keepdim=True)
        return super().forward(x)


class OtherEpsRMS(PlainRMS):
    """A near miss: its forward ignores ``eps`` (uses 1e-3)."""

    def forward(self, x):
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-3)


@pytest.mark.parametrize("cls", [PlainRMS, OnePlusRMS, UpcastRMS])
def test_rms_shaped_matched(cls):
    mod = cls(6).double()
    w = mod.weight
    saved = w.detach().clone()
    assert match_module(mod) == ("rmsnorm", "")
    assert mod.weight is w and torch.equal(w, saved)  # the probe restored the module's weight
    assert tuple(mod.state_dict()) == ("weight",)


@pytest.mark.parametrize("cls", [CentredRMS, OtherEpsRMS])
def test_rms_near_miss_falls_back(cls):
    mod = cls(6)
    kind, why = match_module(mod)
    assert kind is None and "RMSNorm-shaped" in why and "not provably exact" in why
    for untraceable in (False, True):  # fx traces through it (its weight may be an added
        # parameter there); under surgery it is a fallback with that reason
        net = Net(nn.Linear(4, 6), copy.deepcopy(mod), nn.Linear(6, 3), untraceable).double()
        info = get_info(prepare(net, example_inputs=(_data()[0][:2],)))
        assert all(spec.kind != "rmsnorm" for spec in info.layers)
        if untraceable:  # not a norm layer, but replayed per sample (exact: tengrad_fx.capture.replay)
            assert info.covered["n.weight"] == "n.weight" and "_tengrad_replay" in net.n.__dict__


@pytest.mark.parametrize("cls", [PlainRMS, OnePlusRMS, UpcastRMS])
@pytest.mark.parametrize("untraceable", [False, True])
def test_rms_shaped_exact(cls, untraceable):
    """Per-sample gradients, Grams, ``J v``, ``Jᵀc`` of every layer against ``vmap(grad)``
    (float64; the float32 upcast keeps the module's rounding, so layers before it see
    float32-accurate reference gradients), and the outputs equal the module's (to rounding
    for the forms written with other ops)."""
    torch.manual_seed(0)
    net = Net(nn.Linear(4, 6), cls(6, eps=1e-5), nn.Linear(6, 3), untraceable).double()
    orig = copy.deepcopy(net)
    x, y = _data(4)
    pm = prepare(net, example_inputs=(x[:2],))
    assert get_info(pm).covered["n.weight"] == "n"
    out, want = pm(x), orig(x)  # the float32 form reproduces the module bit for bit
    assert torch.equal(out, want) if cls is UpcastRMS else torch.allclose(out, want, rtol=1e-12, atol=0)
    check_covered_layers(orig, pm, x, y, tol=1e-6 if cls is UpcastRMS else 1e-10)
    opt = tengrad_fx.TENGraD(pm, lr=1.0, damping=0.05, momentum=0.0, curvature_every=1, kl_clip=None)
    for p in pm.parameters():
        p.grad = None
    check_tengrad_step(pm, opt, orig, x, y, 0.05, tol=1e-4 if cls is UpcastRMS else 1e-8)  # solve amplifies
