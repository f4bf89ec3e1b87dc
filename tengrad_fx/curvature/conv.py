"""Curvature kernel for ``nn.Conv1d/2d/3d`` (any stride, padding, dilation, groups).

Positions are output pixels. ``A`` holds the unfolded input patches per group,
``[m, g, S, (c_in/g)·Πk]`` (the weight's own ``[c_out, c_in/g, *k]`` order), and ``B`` the
output gradients ``[m, g, S, c_out/g]``. ``jvp``/``vjp`` never unfold: they are one
convolution and one weight-gradient convolution on the stored ``I`` and ``G``.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from ..capture.match import LayerSpec
from ..capture.ops import per_sample_conv_weight_grads

__all__ = ["unfold", "layout", "dims", "jvp", "vjp", "per_sample_grads"]


def unfold(x: Tensor, kernel: tuple[int, ...], stride: tuple[int, ...],
           padding: tuple[int, ...], dilation: tuple[int, ...]) -> Tensor:
    """Patches of ``x [m, c, *spatial]`` as ``[m, S, c·Πk]`` (c-major, then kernel dims)."""
    nd = len(kernel)
    if any(padding):
        x = F.pad(x, [p for p in reversed(padding) for _ in range(2)])
    for d in range(nd):
        span = dilation[d] * (kernel[d] - 1) + 1
        x = x.unfold(2 + d, span, stride[d])
        if dilation[d] > 1:
            x = x[..., :: dilation[d]]
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
    cols = unfold(I, tuple(w.shape[2:]), spec.stride, spec.padding, spec.dilation)  # [m,S,c·Πk]
    S = cols.shape[1]
    A = cols.reshape(m, S, g, -1).transpose(1, 2)
    B = G.reshape(m, g, w.shape[0] // g, S).transpose(2, 3)
    return A, B


def dims(spec: LayerSpec, in_shape: tuple[int, ...]) -> tuple[int, int, int, int]:
    """``(g, S, f, o)`` for a (padded) input of shape ``in_shape``."""
    w = spec.weight
    S = 1
    for d, n in enumerate(in_shape[2:]):
        k, s, p, dl = w.shape[2 + d], spec.stride[d], spec.padding[d], spec.dilation[d]
        S *= (n + 2 * p - dl * (k - 1) - 1) // s + 1
    f = w.shape[1]
    for k in w.shape[2:]:
        f *= k
    return spec.groups, S, f, w.shape[0] // spec.groups


def _conv(spec: LayerSpec, x: Tensor, w: Tensor, b: Optional[Tensor]) -> Tensor:
    nd = w.dim() - 2
    return torch.ops.aten.convolution(x, w, b, list(spec.stride), list(spec.padding),
                                      list(spec.dilation), False, [0] * nd, spec.groups)


def jvp(spec: LayerSpec, I: Tensor, G: Tensor, vW: Tensor, vb: Optional[Tensor]) -> Tensor:
    """``J v`` for ``v = (vW [c_out, c_in/g, *k], vb [c_out])``, ``[m]``."""
    return (_conv(spec, I, vW, vb) * G).flatten(1).sum(1)


def vjp(spec: LayerSpec, I: Tensor, G: Tensor, c: Tensor) -> tuple[Tensor, Tensor]:
    """``Jᵀ c`` as ``(weight [c_out, c_in/g, *k], bias [c_out])``."""
    w = spec.weight
    nd = w.dim() - 2
    Gc = G * c.reshape(-1, *([1] * (G.dim() - 1)))
    _, gW, gb = torch.ops.aten.convolution_backward(
        Gc, I, w.detach().to(I.dtype), [w.shape[0]], list(spec.stride), list(spec.padding),
        list(spec.dilation), False, [0] * nd, spec.groups, [False, True, True],
    )
    return gW, gb


def per_sample_grads(spec: LayerSpec, I: Tensor, G: Tensor) -> tuple[Tensor, Tensor]:
    """``(dW [m, weight.numel()], db [m, c_out])`` by one grouped weight-gradient
    convolution over the batch (aten's kernel; no unfolded input in memory)."""
    w = spec.weight
    P = per_sample_conv_weight_grads(G, I, w.shape, list(spec.stride), list(spec.padding),
                                     list(spec.dilation), spec.groups)
    return P, G.flatten(2).sum(2)
