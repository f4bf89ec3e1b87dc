"""Per-sample conv weight gradients by every method against ``torch.func`` (float64).

``per_sample_conv_weight_grads`` picks a method per layer and device (depthwise GEMV, unfold +
bmm, grouped weight-gradient convolution); each must equal ``vmap(grad(...))`` of the plain
convolution on fresh random inputs and output gradients (the forced ``"unfold"`` mode runs
the depthwise and unfold forms on CPU, where ``"auto"`` prefers the grouped convolution),
and ``"auto"`` must pick the method its documented rule names on CUDA and on CPU.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.func import grad, vmap

from tengrad_fx.capture import per_sample_conv as psc

# (name, c_in, c_out, kernel, stride, padding, dilation, groups, spatial, transposed, auto's method on CUDA)
CASES = [
    ("dense3x3", 3, 4, (3, 3), (1, 1), (1, 1), (1, 1), 1, (6, 7), False, "grouped"),
    ("dense_strided_dilated", 3, 4, (3, 2), (2, 1), (2, 0), (2, 2), 1, (9, 8), False, "grouped"),
    ("pointwise", 5, 3, (1, 1), (1, 1), (0, 0), (1, 1), 1, (4, 5), False, "unfold"),
    ("pointwise_strided", 5, 3, (1, 1), (2, 2), (0, 0), (1, 1), 1, (5, 6), False, "unfold"),
    ("pointwise_padded", 2, 3, (1, 1), (1, 1), (1, 0), (1, 1), 1, (4, 4), False, "grouped"),
    ("grouped", 4, 6, (3, 3), (1, 1), (1, 1), (1, 1), 2, (5, 5), False, "unfold"),
    ("grouped_strided_dilated", 6, 4, (2, 3), (2, 1), (1, 2), (1, 2), 2, (7, 8), False, "unfold"),
    ("depthwise", 4, 4, (3, 3), (1, 1), (1, 1), (1, 1), 4, (6, 6), False, "depthwise"),
    ("depthwise_mult2_strided", 3, 6, (3, 3), (2, 2), (1, 1), (1, 1), 3, (7, 6), False, "depthwise"),
    ("depthwise_dilated", 3, 3, (3, 3), (1, 1), (2, 2), (2, 2), 3, (6, 7), False, "depthwise"),
    ("conv1d_dense", 3, 4, (5,), (2,), (2,), (1,), 1, (13,), False, "grouped"),
    ("conv1d_depthwise", 4, 4, (3,), (1,), (1,), (2,), 4, (11,), False, "depthwise"),
    ("conv1d_grouped", 4, 6, (3,), (2,), (0,), (1,), 2, (12,), False, "unfold"),
    ("conv3d_fallback", 2, 4, (3, 2, 1), (1, 2, 1), (1, 0, 0), (1, 1, 1), 2, (4, 5, 3), False, "grouped"),
    ("transposed_fallback", 4, 3, (3, 3), (2, 2), (1, 1), (1, 1), 1, (4, 4), True, "grouped"),
]


def _conv(x, w, stride, padding, dilation, groups, transposed):  # type: ignore[no-untyped-def]
    nd = w.dim() - 2
    if transposed:
        return getattr(F, f"conv_transpose{nd}d")(x, w, None, stride, padding, 0, groups, dilation)
    return getattr(F, f"conv{nd}d")(x, w, None, stride, padding, dilation, groups)


@pytest.mark.parametrize("mode", ["auto", "grouped", "unfold"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_per_sample_conv_weight_grads_match_torch_func(case, mode: str) -> None:
    name, c_in, c_out, k, stride, padding, dilation, groups, spatial, transposed, expected = case
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    m = 5
    wshape = (c_in, c_out // groups, *k) if transposed else (c_out, c_in // groups, *k)
    w = torch.randn(wshape, generator=g, dtype=torch.float64)
    x = torch.randn(m, c_in, *spatial, generator=g, dtype=torch.float64)
    y = _conv(x, w, stride, padding, dilation, groups, transposed)
    G = torch.randn(y.shape, generator=g, dtype=torch.float64)

    def loss(wt, xi, gi):  # type: ignore[no-untyped-def]
        return (_conv(xi[None], wt, stride, padding, dilation, groups, transposed) * gi[None]).sum()

    ref = vmap(grad(loss), in_dims=(None, 0, 0))(w, x, G).reshape(m, -1)
    assert psc.method_for(wshape, groups, padding, transposed, "cuda", mode="auto") == expected
    on_cpu = "unfold" if expected == "unfold" and groups == 1 else "grouped"  # only 1×1 convs leave grouped
    assert psc.method_for(wshape, groups, padding, transposed, "cpu", mode="auto") == on_cpu
    forced = psc.method_for(wshape, groups, padding, transposed, "cpu", mode="unfold")
    assert forced == ("grouped" if transposed or len(k) == 3 else "depthwise" if expected == "depthwise" else "unfold")
    with psc.per_sample_conv_method(mode):
        P = psc.per_sample_conv_weight_grads(G, x, wshape, stride, padding, dilation, groups, transposed=transposed)
    assert P.shape == (m, w.numel()) and P.dtype == torch.float64
    assert torch.allclose(P, ref, rtol=1e-12, atol=1e-12), (P - ref).abs().max()


def test_unfold_is_chunked_over_samples_exactly(monkeypatch) -> None:
    """Past ``UNFOLD_BLOCK_BYTES`` the unfolded input is made in sample chunks: same result."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 4, 6, 6, generator=g, dtype=torch.float64)
    G = torch.randn(7, 4, 6, 6, generator=g, dtype=torch.float64)
    args = (G, x, (4, 1, 3, 3), (1, 1), (1, 1), (1, 1), 4)
    whole = psc.per_sample_conv_weight_grads(*args)
    monkeypatch.setattr(psc, "UNFOLD_BLOCK_BYTES", 2 * 4 * 36 * 9 * 8)  # two samples per chunk
    assert torch.equal(psc.per_sample_conv_weight_grads(*args), whole)
    with psc.per_sample_conv_method("grouped"):
        assert torch.allclose(psc.per_sample_conv_weight_grads(*args), whole, rtol=1e-12, atol=1e-12)


def test_bad_method_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="auto"):
        with psc.per_sample_conv_method("im2col"):
            pass
