"""Norm layers (BatchNorm, LayerNorm, GroupNorm, RMSNorm, timm's variants): exact
per-sample gradients, Grams, Jv and Jᵀc against ``torch.func`` on the ORIGINAL model.

Eval mode: every per-sample gradient is exactly ``∂ℓ_i/∂θ`` (``vmap(grad)``, float64).
BatchNorm in train mode (the stated convention, ``tengrad_fx.capture.norm``): the per-sample
gradients sum to the exact train-mode batch gradient, and for the BatchNorm and every layer
after it they equal ``vmap(grad)`` of the network whose BatchNorm uses the batch
statistics as constants.
"""
from __future__ import annotations

import copy

import pytest
import timm.layers as tl
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import tengrad_fx
from tengrad_fx.capture.norm import BN_NOTE, NORM_KINDS
from testing import explicit_jacobian, per_sample_grads_reference

TOL = 1e-10


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


class _Net(nn.Module):
    """``pre`` (conv or linear), the norm, tanh, flatten, Linear head (8 classes)."""

    def __init__(self, pre: nn.Module, norm: nn.Module, n_flat: int):
        super().__init__()
        self.pre, self.norm, self.head = pre, norm, nn.Linear(n_flat, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.norm(self.pre(x))).flatten(1))


def build(kind: str, C: int, S: int, groups: int, affine: bool, bias: bool) -> tuple[nn.Module, tuple[int, ...]]:
    """A net around one norm layer of ``kind`` with ``C`` channels/features and ``S``
    positions per sample; returns ``(model, input shape without batch)``."""
    h = max(1, int(round(S ** 0.5)))
    if kind in ("gn", "timm_gn"):
        h = max(2, h)  # torch refuses a group of one value in train mode (as the probe runs)
    conv = lambda k=1: nn.Conv2d(2, C * k, 3, padding=1)
    if kind == "bn1d":
        return _Net(nn.Linear(3, C), nn.BatchNorm1d(C, affine=affine), C), (3,)
    if kind == "bn1d_seq":  # [m, C, L]
        return _Net(nn.Conv1d(2, C, 3, padding=1), nn.BatchNorm1d(C, affine=affine), C * S), (2, S)
    if kind == "bn2d":
        return _Net(conv(), nn.BatchNorm2d(C, affine=affine), C * h * h), (2, h, h)
    if kind == "bn3d":
        return _Net(nn.Conv3d(2, C, 1), nn.BatchNorm3d(C, affine=affine), C * 2 * h * h), (2, 2, h, h)
    if kind == "ln":  # LayerNorm over the features of tokens [m, S, C]
        return _Net(nn.Linear(3, C), nn.LayerNorm(C, elementwise_affine=affine, bias=bias), S * C), (S, 3)
    if kind == "ln2":  # LayerNorm over the last two dims of a feature map
        return _Net(conv(), nn.LayerNorm((h, h), elementwise_affine=affine, bias=bias), C * h * h), (2, h, h)
    if kind == "gn":
        return _Net(conv(groups), nn.GroupNorm(groups, C * groups, affine=affine), C * groups * h * h), (2, h, h)
    if kind == "rms":
        return _Net(nn.Linear(3, C), nn.RMSNorm(C, elementwise_affine=affine), S * C), (S, 3)
    if kind == "timm_ln2d":
        return _Net(conv(), tl.LayerNorm2d(C, affine=affine), C * h * h), (2, h, h)
    if kind == "timm_ln":
        return _Net(nn.Linear(3, C), tl.LayerNorm(C, affine=affine), S * C), (S, 3)
    if kind == "timm_gn":
        return _Net(conv(groups), tl.GroupNorm(num_channels=C * groups, num_groups=groups, affine=affine),
                    C * groups * h * h), (2, h, h)
    if kind == "timm_rms":
        return _Net(nn.Linear(3, C), tl.RmsNorm(C, affine=affine), S * C), (S, 3)
    if kind == "timm_rms2d":
        return _Net(conv(), tl.RmsNorm2d(C, affine=affine), C * h * h), (2, h, h)
    if kind == "timm_bnact":
        return _Net(conv(), tl.BatchNormAct2d(C, affine=affine, act_layer=nn.ReLU), C * h * h), (2, h, h)
    raise ValueError(kind)


KINDS = ["bn1d", "bn1d_seq", "bn2d", "bn3d", "ln", "ln2", "gn", "rms", "timm_ln2d", "timm_ln",
         "timm_gn", "timm_rms", "timm_rms2d", "timm_bnact"]


def _randomize(model: nn.Module, gen: torch.Generator) -> None:
    """Non-trivial γ, β and running statistics (defaults are 1, 0, 0, 1)."""
    with torch.no_grad():
        for mod in model.modules():
            for name in ("weight", "bias"):
                p = getattr(mod, name, None)
                if isinstance(p, nn.Parameter) and mod is model.norm:
                    p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype))
            if getattr(mod, "running_var", None) is not None:
                mod.running_mean.copy_(torch.randn(mod.running_mean.shape, generator=gen, dtype=torch.float64))
                mod.running_var.copy_(torch.rand(mod.running_var.shape, generator=gen, dtype=torch.float64) + 0.5)


def _prepared(kind: str, C: int, S: int, groups: int, affine: bool, bias: bool, m: int, seed: int):  # type: ignore[no-untyped-def]
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model, shape = build(kind, C, S, groups, affine, bias)
    model = model.double()
    _randomize(model, gen)
    orig = copy.deepcopy(model)
    x = torch.randn(m, *shape, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 8, (m,), generator=gen)
    prepared = tengrad_fx.prepare(model, example_inputs=(x[:2],))
    return orig, prepared, x, y


def _norm_layer(prepared: nn.Module):  # type: ignore[no-untyped-def]
    layers = [layer for layer in tengrad_fx.covered_layers(prepared) if layer.kind in NORM_KINDS]
    return layers[0] if layers else None


@settings(max_examples=40, deadline=None)
@given(kind=st.sampled_from(KINDS), C=st.integers(1, 5), S=st.sampled_from([1, 4, 9]),
       groups=st.integers(1, 3), affine=st.booleans(), bias=st.booleans(), m=st.integers(2, 5),
       seed=st.integers(0, 2**16))
def test_norm_layers_exact_in_eval_mode(kind, C, S, groups, affine, bias, m, seed) -> None:  # type: ignore[no-untyped-def]
    orig, prepared, x, y = _prepared(kind, C, S, groups, affine, bias, m, seed)
    orig.eval()
    prepared.eval()
    F.cross_entropy(prepared(x), y).backward()
    layer = _norm_layer(prepared)
    info = tengrad_fx.get_info(prepared)
    if not affine:  # no parameters: nothing to cover, nothing reported
        assert layer is None and not any(k.startswith("norm.") for k in info.fallback)
        return
    assert layer is not None, info.fallback
    ref = per_sample_grads_reference(orig, x, F.cross_entropy, y)
    wn = "norm.weight"
    bn = "norm.bias" if layer.bias is not None else None
    dW, db = layer.per_sample_grads()
    assert rel(dW, ref[wn]) <= TOL
    if bn is not None:
        assert rel(db, ref[bn]) <= TOL
    J = explicit_jacobian(ref, wn, bn)
    K = J @ J.T
    for strategy in ("factor", "materialize", "auto"):
        assert rel(layer.gram(strategy), K) <= TOL, strategy
    assert layer.choose("auto") == "materialize"  # the cost model: [m, C] is always cheapest
    gen = torch.Generator().manual_seed(seed + 1)
    v = torch.randn(J.shape[1], generator=gen, dtype=torch.float64)
    nw = layer.weight.numel()
    vb = v[nw:].view_as(layer.bias) if layer.bias is not None else None
    assert rel(layer.jvp(v[:nw].view_as(layer.weight), vb), J @ v) <= TOL
    c = torch.randn(m, generator=gen, dtype=torch.float64)
    gw, gb = layer.vjp(c)
    got = gw.flatten() if gb is None else torch.cat([gw.flatten(), gb.flatten()])
    assert rel(got, J.T @ c) <= TOL


@pytest.mark.parametrize("kind", ["bn1d", "bn2d", "bn3d", "timm_bnact"])
def test_batchnorm_train_mode_convention(kind: str) -> None:
    """Train mode: Σ_i (per-sample) = the exact batch gradient for every layer; BN and
    the head equal vmap(grad) with the batch statistics held fixed; running stats and
    outputs are the module's, bit for bit."""
    orig, prepared, x, y = _prepared(kind, 3, 4, 1, True, True, 6, 0)
    twin = copy.deepcopy(orig)
    orig.train()
    prepared.train()
    out = prepared(x)
    ref_out = orig(x)
    assert torch.equal(out, ref_out)
    for (k, a), (_, b) in zip(prepared.named_buffers(), orig.named_buffers(), strict=True):
        assert torch.equal(a, b), k
    F.cross_entropy(out, y).backward()
    F.cross_entropy(ref_out, y).backward()
    m = x.shape[0]
    pnames = {id(p): n for n, p in prepared.named_parameters()}
    grads = {n: p.grad for n, p in orig.named_parameters()}
    for layer in tengrad_fx.covered_layers(prepared):
        for ps, p in zip(layer.per_sample_grads(), (layer.weight, layer.bias)):
            # relative to the terms: a bias before a BN has a zero batch gradient
            assert (ps.mean(0) - grads[pnames[id(p)]]).norm() <= TOL * ps.norm(), layer.name
    # the network with the batch statistics as constants: eval mode with running := batch stats
    pre = twin.pre(x)
    dims = [0] + list(range(2, pre.dim()))
    bn = twin.norm
    with torch.no_grad():
        bn.running_mean.copy_(pre.mean(dims))
        bn.running_var.copy_(pre.var(dims, unbiased=False))
    twin.eval()
    ref = per_sample_grads_reference(twin, x, F.cross_entropy, y)
    for layer in tengrad_fx.covered_layers(prepared):
        if layer.name in ("norm", "head"):
            dW, db = layer.per_sample_grads()
            assert rel(dW, ref[f"{layer.name}.weight"]) <= TOL, layer.name
            assert rel(db, ref[f"{layer.name}.bias"]) <= TOL, layer.name
    assert m == 6
    assert BN_NOTE in str(tengrad_fx.report(prepared))


@pytest.mark.parametrize("kind,C,train", [("bn2d", 3, False), ("bn2d", 3, True), ("bn1d", 1, True),
                                          ("ln", 3, False), ("gn", 3, False), ("rms", 3, False)])
def test_norm_materialized_in_backward(kind: str, C: int, train: bool) -> None:
    """Sites the optimizer materializes record ``P``, ``Gsum`` ``[m, C]`` and no ``x̂``;
    gradients and per-sample gradients are unchanged (``bn1d``, ``C = 1``, train mode: one
    position and one channel, whose batch statistics must reach aten's kernel as a dense
    ``[m]`` vector, not a stride-0 view)."""
    orig, prepared, x, y = _prepared(kind, C, 4, 2, True, True, 5, 3)
    orig.train(train)
    prepared.train(train)
    F.cross_entropy(prepared(x), y).backward()
    layer = _norm_layer(prepared)
    ref_psg = layer.per_sample_grads()
    ref_grads = [p.grad.clone() for p in prepared.parameters()]
    info = tengrad_fx.get_info(prepared)
    info.store.jacobian_sites = set(layer.spec.sites)
    prepared.zero_grad()
    F.cross_entropy(prepared(x), y).backward()
    rec = layer.records()[0]
    assert rec.I is None and rec.P is not None and rec.P.shape == (5, layer.weight.numel())
    assert layer.materialized
    for a, b in zip(layer.per_sample_grads(), ref_psg):
        if b is not None:
            assert rel(a, b) <= TOL
    for p, g in zip(prepared.parameters(), ref_grads):
        assert rel(p.grad, g) <= 1e-12


def test_norm_capture_off_is_the_module() -> None:
    """With capture off the module's own forward runs (no capture op in the graph)."""
    orig, prepared, x, y = _prepared("bn2d", 3, 4, 1, True, True, 4, 1)
    with tengrad_fx.capturing(prepared, False):
        out = prepared(x)
    assert "tengrad" not in str(out.grad_fn.next_functions)
    assert torch.equal(out, orig(x))


def test_overridden_norm_forward_falls_back_with_reason() -> None:
    class Odd(nn.BatchNorm2d):
        def forward(self, x):  # type: ignore[no-untyped-def]
            return super().forward(x) * 2

    net = nn.Sequential(nn.Conv2d(2, 3, 1), Odd(3), nn.Flatten(), nn.Linear(3 * 4, 2))
    prepared = tengrad_fx.prepare(net, example_inputs=(torch.randn(2, 2, 2, 2),))
    info = tengrad_fx.get_info(prepared)
    assert "overrides BatchNorm2d.forward" in info.fallback["1.weight"]
    assert "1.weight" not in info.covered and "0.weight" in info.covered
