"""Curvature kernel for ``nn.Conv1d/2d/3d`` and ``nn.ConvTranspose1d/2d/3d`` (any stride,
padding, dilation, groups; output_padding for the transposed ones).

Convolution: positions are output pixels. ``A`` holds the unfolded input patches per group,
``[m, g, S, (c_in/g)·Πk]`` (the weight's own ``[c_out, c_in/g, *k]`` order), and ``B`` the
output gradients ``[m, g, S, c_out/g]``.

Transposed convolution (weight ``[c_in, c_out/g, *k]``): ``y = Cᵀx`` where ``C`` is the
convolution with the same weight and geometry mapping ``y``-space to ``x``-space, so
``∂ℓ/∂W = Σ_s x[s] · unfold(G)[s]``: the roles of input and output gradient swap. Positions
are INPUT pixels, ``A = unfold(G)`` ``[m, g, S_in, (c_out/g)·Πk]`` (cropped to the input
size when ``output_padding`` adds trailing positions), ``B = x`` ``[m, g, S_in, c_in/g]``;
the bias gradient is ``Σ_t G[t]`` over output pixels (:func:`bias_grads`), not ``Σ_s B``.
The same cost model then applies with ``S = S_in``, ``f = (c_out/g)·Πk``, ``o = c_in/g``.

``jvp``/``vjp`` never unfold: they are one (transposed) convolution and one
weight-gradient convolution on the stored ``I`` and ``G``.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from ..capture.match import LayerSpec
from ..capture.per_sample_conv import per_sample_conv_weight_grads

__all__ = ["unfold", "layout", "dims", "jvp", "vjp", "per_sample_grads", "bias_grads"]


def unfold(x: Tensor, kernel: tuple[int, ...], stride: tuple[int, ...],
           padding: tuple[int, ...], dilation: tuple[int, ...],
           limit: Optional[tuple[int, ...]] = None) -> Tensor:
    """Patches of ``x [m, c, *spatial]`` as ``[m, S, c·Πk]`` (c-major, then kernel dims);
    ``limit``: keep only the first ``limit[d]`` positions along each spatial dim."""
    nd = len(kernel)
    if any(padding):
        x = F.pad(x, [p for p in reversed(padding) for _ in range(2)])
    for d in range(nd):
        span = dilation[d] * (kernel[d] - 1) + 1
        x = x.unfold(2 + d, span, stride[d])
        if dilation[d] > 1:
            x = x[..., :: dilation[d]]
        if limit is not None:
            x = x.narrow(2 + d, 0, limit[d])
    m, c = x.shape[:2]
    out = x.shape[2:2 + nd]
    perm = [0, *range(2, 2 + nd), 1, *range(2 + nd, 2 + 2 * nd)]
    S = 1
    for s in out:
        S *= s
    return x.permute(perm).reshape(m, S, -1)


def layout(spec: LayerSpec, I: Tensor, G: Tensor) -> tuple[Tensor, Tensor]:
    """``(A [m, g, S, f], B [m, g, S, o])`` with ``f = c_in/g·Πk``, ``o = c_out/g``."""
    w = spec.weight
    g = spec.groups
    m = I.shape[0]
    if spec.transposed:  # roles swapped: patches of G at the input's positions, B = I
        cols = unfold(G, tuple(w.shape[2:]), spec.stride, spec.padding, spec.dilation,
                      limit=tuple(I.shape[2:]))
        S = cols.shape[1]
        return cols.reshape(m, S, g, -1).transpose(1, 2), I.reshape(m, g, w.shape[0] // g, S).transpose(2, 3)
    cols = unfold(I, tuple(w.shape[2:]), spec.stride, spec.padding, spec.dilation)  # [m,S,c·Πk]
    S = cols.shape[1]
    A = cols.reshape(m, S, g, -1).transpose(1, 2)
    B = G.reshape(m, g, w.shape[0] // g, S).transpose(2, 3)
    return A, B


def dims(spec: LayerSpec, in_shape: tuple[int, ...]) -> tuple[int, int, int, int]:
    """``(g, S, f, o)`` for a (padded) input of shape ``in_shape``."""
    w = spec.weight
    S = 1
    if spec.transposed:
        for n in in_shape[2:]:
            S *= n
        return spec.groups, S, w[0].numel(), w.shape[0] // spec.groups
    for d, n in enumerate(in_shape[2:]):
        k, s, p, dl = w.shape[2 + d], spec.stride[d], spec.padding[d], spec.dilation[d]
        S *= (n + 2 * p - dl * (k - 1) - 1) // s + 1
    f = w.shape[1]
    for k in w.shape[2:]:
        f *= k
    return spec.groups, S, f, w.shape[0] // spec.groups


def _geometry(spec: LayerSpec, I: Tensor, G: Tensor) -> tuple[list[int], list[int], list[int], bool, list[int], int]:
    """``(stride, padding, dilation, transposed, output_padding, groups)`` as aten takes them.

    A transposed convolution's ``output_padding`` is read off the captured shapes (it may
    differ per call: ``ConvTransposeNd(x, output_size=...)``)."""
    w = spec.weight
    nd = w.dim() - 2
    op = [0] * nd
    if spec.transposed:
        op = [G.shape[2 + d] - ((I.shape[2 + d] - 1) * spec.stride[d] - 2 * spec.padding[d]
                                + spec.dilation[d] * (w.shape[2 + d] - 1) + 1) for d in range(nd)]
    return list(spec.stride), list(spec.padding), list(spec.dilation), spec.transposed, op, spec.groups


def jvp(spec: LayerSpec, I: Tensor, G: Tensor, vW: Tensor, vb: Optional[Tensor]) -> Tensor:
    """``J v`` for ``v = (vW [c_out, c_in/g, *k], vb [c_out])``, ``[m]``."""
    return (torch.ops.aten.convolution(I, vW, vb, *_geometry(spec, I, G)) * G).flatten(1).sum(1)


def vjp(spec: LayerSpec, I: Tensor, G: Tensor, c: Tensor) -> tuple[Tensor, Tensor]:
    """``Jᵀ c`` as ``(weight [c_out, c_in/g, *k], bias [c_out])``."""
    w = spec.weight
    Gc = G * c.reshape(-1, *([1] * (G.dim() - 1)))
    _, gW, gb = torch.ops.aten.convolution_backward(
        Gc, I, w.detach().to(I.dtype), [G.shape[1]], *_geometry(spec, I, G), [False, True, True],
    )
    return gW, gb


def per_sample_grads(spec: LayerSpec, I: Tensor, G: Tensor) -> tuple[Tensor, Tensor]:
    """``(dW [m, weight.numel()], db [m, c_out])``, the weight part by the layer's method
    (:mod:`tengrad_fx.capture.per_sample_conv`: grouped convolution, unfold + bmm, depthwise)."""
    stride, padding, dilation, transposed, op, groups = _geometry(spec, I, G)
    P = per_sample_conv_weight_grads(G, I, spec.weight.shape, stride, padding, dilation, groups,
                                     transposed=transposed, output_padding=op)
    return P, bias_grads(spec, I, G)


def bias_grads(spec: LayerSpec, I: Tensor, G: Tensor) -> Tensor:
    """Per-sample bias gradients ``Σ_t G[:, :, t]`` over output pixels, ``[m, c_out]``."""
    return G.flatten(2).sum(2)
