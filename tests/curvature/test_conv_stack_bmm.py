"""Stacked convolutions with few output positions by ``bmm`` (``curvature.conv_stack_bmm``),
against ``torch.func`` (float64).

``L = 3`` layers of one geometry, each with its own random input and output gradient: the
``bmm`` form's ``J v``, ``Jᵀ c``, ``β·g + γ·Jᵀc`` and ``Jᵀ1`` at a few channels equal the products of each
layer's explicit ``J`` (rows ``vec(∂/∂W, ∂/∂b)`` of ``Σ conv(x_i)·G_i`` by
``vmap(grad(...))``) and the grouped-convolution form of ``curvature.conv_stack``; and which
stacks take the form.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from tengrad_fx.curvature import conv_stack, conv_stack_bmm
from testing.oracle import stacked_layer_jacobians

# (name, c_in, c_out, kernel, stride, padding, dilation, spatial, bias): outputs of 1 to 4 positions
CASES = [
    ("out1x1_pad", 3, 5, (3, 3), (1, 1), (1, 1), (1, 1), (1, 1), True),
    ("out1x1_stride2", 4, 3, (3, 3), (2, 2), (1, 1), (1, 1), (2, 2), False),
    ("out2x2_stride2_pad", 3, 4, (3, 3), (2, 2), (1, 1), (1, 1), (4, 4), True),
    ("out2x2_pad", 2, 3, (3, 3), (1, 1), (1, 1), (1, 1), (2, 2), False),
    ("out2x1_dilated", 2, 3, (2, 3), (2, 1), (0, 1), (1, 2), (4, 3), True),
    ("pointwise_stride2", 5, 2, (1, 1), (2, 2), (0, 0), (1, 1), (3, 3), True),
    ("conv1d_out3", 3, 4, (3,), (2,), (1,), (1,), (5,), True),
    ("conv3d_out2", 2, 3, (3, 3, 2), (2, 2, 1), (1, 1, 0), (1, 1, 1), (2, 2, 3), True),
]


def _conv(x, w, b, stride, padding, dilation, groups=1):  # type: ignore[no-untyped-def]
    return getattr(F, f"conv{w.dim() - 2}d")(x, w, b, stride, padding, dilation, groups)


def _stack(gen, m, L, c_in, c_out, k, stride, padding, dilation, spatial, groups=1):  # type: ignore[no-untyped-def]
    dt = torch.float64
    w = torch.randn(c_out, c_in // groups, *k, generator=gen, dtype=dt)
    spec = SimpleNamespace(weight=w, stride=stride, padding=padding, dilation=dilation, groups=groups)
    I = torch.randn(m, L, c_in, *spatial, generator=gen, dtype=dt)
    out_shape = _conv(I[:, 0], w, None, stride, padding, dilation, groups).shape
    G = torch.randn(m, L, *out_shape[1:], generator=gen, dtype=dt)
    return spec, w, I, G


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bmm_products_equal_explicit_jacobians_and_the_convolution_form(case) -> None:
    name, c_in, c_out, k, stride, padding, dilation, spatial, bias = case
    gen = torch.Generator().manual_seed(sum(map(ord, name)))
    m, L = 4, 3
    spec, w, I, G = _stack(gen, m, L, c_in, c_out, k, stride, padding, dilation, spatial)
    b = torch.randn(c_out, generator=gen, dtype=torch.float64) if bias else None
    assert conv_stack_bmm.applies(spec, I, G)

    J = stacked_layer_jacobians(lambda x, wt, bt: _conv(x, wt, bt, stride, padding, dilation), w, b, I, G)  # [L, m, n]
    nw = w.numel()
    v = torch.randn(L, J.shape[2], generator=gen, dtype=torch.float64)
    c = torch.randn(L, m, generator=gen, dtype=torch.float64)
    vb = v[:, nw:] if bias else None
    ops = conv_stack_bmm.operands(spec, I, G)

    Jv = conv_stack_bmm.jvp(ops, v[:, :nw], vb)
    assert torch.allclose(Jv, torch.bmm(J, v.unsqueeze(2)).squeeze(2), rtol=1e-11, atol=1e-11)
    assert torch.allclose(Jv, conv_stack.jvp(spec, I, G, v[:, :nw], vb), rtol=1e-11, atol=1e-11)
    JTw, JTb = conv_stack_bmm.vjp(ops, c)
    JTc = torch.bmm(J.transpose(1, 2), c.unsqueeze(2)).squeeze(2)
    assert torch.allclose(JTw, JTc[:, :nw], rtol=1e-11, atol=1e-11)
    conv_w, conv_b = conv_stack.vjp(spec, I, G, c)
    assert torch.allclose(JTw, conv_w, rtol=1e-11, atol=1e-11)
    assert torch.allclose(JTb, conv_b, rtol=1e-11, atol=1e-11)
    if bias:
        assert torch.allclose(JTb, JTc[:, nw:], rtol=1e-11, atol=1e-11)
    g = torch.randn(L, J.shape[2], generator=gen, dtype=torch.float64)
    uw, ub = conv_stack_bmm.woodbury(ops, c, g[:, :nw], g[:, nw:] if bias else None, 0.7, -1.3)
    u = 0.7 * g - 1.3 * JTc
    assert torch.allclose(uw, u[:, :nw], rtol=1e-11, atol=1e-11)
    assert (ub is None) is not bias and (ub is None or torch.allclose(ub, u[:, nw:], rtol=1e-11, atol=1e-11))
    uw, _ = conv_stack_bmm.woodbury(ops, c, torch.full_like(g[:, :nw], float("nan")), None, 0.0, 2.0)
    assert torch.allclose(uw, 2.0 * JTc[:, :nw], rtol=1e-11, atol=1e-11)  # β = 0 reads no g
    rows = torch.tensor([c_out - 1, 0])
    JT1 = J.sum(1)[:, :nw].reshape(L, c_out, -1)
    assert torch.allclose(conv_stack_bmm.channel_sums(ops, rows), JT1[:, rows], rtol=1e-11, atol=1e-11)


@pytest.mark.parametrize("geometry,takes", [
    (dict(c_in=2, c_out=3, k=(3, 3), stride=(1, 1), padding=(1, 1), spatial=(2, 2)), True),  # P = 4, U = 9·I
    (dict(c_in=2, c_out=3, k=(3, 3), stride=(1, 1), padding=(1, 1), spatial=(3, 2)), False),  # P = 6
    (dict(c_in=4, c_out=4, k=(3, 3), stride=(1, 1), padding=(1, 1), spatial=(1, 1), groups=2), False),
    (dict(c_in=2, c_out=3, k=(5, 5), stride=(1, 1), padding=(2, 2), spatial=(1, 1)), False),  # U = 25·I
    (dict(c_in=2, c_out=3, k=(4, 4), stride=(4, 4), padding=(0, 0), spatial=(8, 8)), True),  # P = 4, U = I
])
def test_which_stacks_take_the_bmm_form(geometry: dict, takes: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    geometry.setdefault("groups", 1)
    spec, _, I, G = _stack(gen, 3, 2, dilation=(1, 1), **geometry)
    assert conv_stack_bmm.applies(spec, I, G) is takes
    assert not conv_stack_bmm.applies(SimpleNamespace(**vars(spec), transposed=True), I, G)
