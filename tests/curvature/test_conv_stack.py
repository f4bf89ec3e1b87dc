"""Stacked convolutions (``curvature.conv_stack``) against ``torch.func`` (float64).

``L = 3`` layers of one geometry, each with its own random input and output gradient: the
stacked ``J v``, ``Jᵀ c`` and ``J Jᵀ`` (positions form and materialized, with the
materialized one chunked over layers too) equal the products of each layer's explicit
``J`` (rows ``vec(∂/∂W, ∂/∂b)`` of ``Σ conv(x_i)·G_i`` by ``vmap(grad(...))``).
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from tengrad_fx.curvature import conv_stack
from testing.oracle import stacked_layer_jacobians

# (name, c_in, c_out, kernel, stride, padding, dilation, groups, spatial, bias)
CASES = [
    ("dense2d", 3, 4, (3, 3), (1, 1), (1, 1), (1, 1), 1, (5, 6), True),
    ("strided_dilated", 2, 3, (3, 2), (2, 1), (2, 0), (2, 2), 1, (8, 7), True),
    ("grouped", 4, 6, (3, 3), (1, 1), (1, 1), (1, 1), 2, (4, 5), True),
    ("depthwise_no_bias", 3, 3, (3, 3), (2, 2), (1, 1), (1, 1), 3, (6, 6), False),
    ("pointwise", 5, 2, (1, 1), (1, 1), (0, 0), (1, 1), 1, (3, 4), True),
    ("conv1d", 3, 4, (3,), (2,), (1,), (1,), 1, (9,), True),
    ("conv3d", 2, 4, (2, 3, 1), (1, 2, 1), (1, 0, 0), (1, 1, 1), 2, (3, 5, 2), True),
]


def _conv(x, w, b, case):  # type: ignore[no-untyped-def]
    _, _, _, k, stride, padding, dilation, groups, _, _ = case
    return getattr(F, f"conv{len(k)}d")(x, w, b, stride, padding, dilation, groups)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_stacked_products_equal_explicit_jacobians(case, monkeypatch) -> None:
    name, c_in, c_out, k, stride, padding, dilation, groups, spatial, bias = case
    gen = torch.Generator().manual_seed(sum(map(ord, name)))
    m, L = 5, 3
    dt = torch.float64
    w = torch.randn(c_out, c_in // groups, *k, generator=gen, dtype=dt)
    b = torch.randn(c_out, generator=gen, dtype=dt) if bias else None
    spec = SimpleNamespace(weight=w, stride=stride, padding=padding, dilation=dilation, groups=groups)
    I = torch.randn(m, L, c_in, *spatial, generator=gen, dtype=dt)
    out_shape = _conv(I[:, 0], w, b, case).shape
    G = torch.stack([torch.randn(out_shape, generator=gen, dtype=dt) for _ in range(L)], 1)

    J = stacked_layer_jacobians(lambda x, wt, bt: _conv(x, wt, bt, case), w, b, I, G)  # [L, m, n]
    nw = w.numel()
    v = torch.randn(L, J.shape[2], generator=gen, dtype=dt)
    c = torch.randn(L, m, generator=gen, dtype=dt)

    Jv = conv_stack.jvp(spec, I, G, v[:, :nw], v[:, nw:] if bias else None)
    assert torch.allclose(Jv, torch.bmm(J, v.unsqueeze(2)).squeeze(2), rtol=1e-11, atol=1e-11)
    JTw, JTb = conv_stack.vjp(spec, I, G, c)
    JTc = torch.bmm(J.transpose(1, 2), c.unsqueeze(2)).squeeze(2)
    assert torch.allclose(JTw, JTc[:, :nw], rtol=1e-11, atol=1e-11)
    if bias:
        assert torch.allclose(JTb, JTc[:, nw:], rtol=1e-11, atol=1e-11)
    # Jᵀ1 at a few output channels of every group (the push-through probe's sample)
    og = c_out // groups
    rows = torch.tensor([og - 1, 0, og - 1][: max(1, min(3, og))])
    sums, channels = conv_stack.channel_sums(spec, I, G, rows)
    assert channels.tolist() == [j * og + int(r) for j in range(groups) for r in rows]
    JT1 = J.sum(1)[:, :nw].reshape(L, c_out, -1)
    assert torch.allclose(sums, JT1[:, channels], rtol=1e-11, atol=1e-11)
    K = torch.bmm(J, J.transpose(1, 2))
    for how in ("factor", "materialize"):
        got = conv_stack.gram(spec, I, G, how, bias)
        assert got.shape == (L, m, m)
        assert torch.allclose(got, K, rtol=1e-11, atol=1e-10), (how, (got - K).abs().max())
    # small blocks: sample blocks of the positions form, one layer per materialized chunk
    assert torch.allclose(conv_stack.gram(spec, I, G, "factor", bias, block_bytes=1), K, rtol=1e-11, atol=1e-10)
    monkeypatch.setattr(conv_stack, "STACK_BLOCK_BYTES", 1)
    assert torch.allclose(conv_stack.gram(spec, I, G, "materialize", bias), K, rtol=1e-11, atol=1e-10)
    if len(k) == 2:  # stacks of channels-last captures (timm models): same products
        def cl(X: torch.Tensor) -> torch.Tensor:
            return torch.stack([X[:, i].contiguous(memory_format=torch.channels_last) for i in range(L)], 1)
        Ic, Gc = cl(I), cl(G)
        assert torch.allclose(conv_stack.jvp(spec, Ic, Gc, v[:, :nw], v[:, nw:] if bias else None), Jv,
                              rtol=1e-11, atol=1e-11)
        assert torch.allclose(conv_stack.vjp(spec, Ic, Gc, c)[0], JTw, rtol=1e-11, atol=1e-11)
        for how in ("factor", "materialize"):
            assert torch.allclose(conv_stack.gram(spec, Ic, Gc, how, bias), K, rtol=1e-11, atol=1e-10)
