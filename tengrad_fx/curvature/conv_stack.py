"""Curvature products of ``L`` convolutions of one shape at once (factored form: ``I, G``).

``L`` layers with the same weight shape, geometry (stride, padding, dilation, groups) and
input/output shapes, each kept as its captured input and output gradient, are stacked
along a layer axis right after the sample axis:

* ``I [m, L, c_in, *spatial]``, ``G [m, L, c_out, *spatial_out]``;
* weight-shaped tensors flat per layer, ``[L, n_w]`` (``n_w = c_out·c_in/g·Πk``),
  bias-shaped ``[L, c_out]``; ``c`` and ``J v`` are ``[L, m]``.

Folding the layer axis into the channels (``I → [m, L·c_in, *spatial]``) turns the ``L``
convolutions into ONE convolution with ``L·g`` groups, so every product below is one
aten call for the whole stack, whatever ``L``:

* ``J v``: a forward convolution of ``I`` with the stacked ``v`` (``L·g`` groups), times
  ``G``, summed over channels and positions;
* ``Jᵀ c``: one weight-gradient convolution of ``I`` with ``c``-weighted ``G``;
* ``J Jᵀ``: ``"factor"`` by :func:`~tengrad_fx.curvature.tensors.gram_factor_stacked`
  (one ``bmm`` over ``L·g`` per sample block), ``"materialize"`` by per-sample gradients of
  the ``m·L`` (sample, layer) pairs (:mod:`tengrad_fx.capture.per_sample_conv`) and their
  Gram (:func:`~tengrad_fx.curvature.materialized.gram`, one ``bmm``), in chunks of layers
  holding at most :data:`STACK_BLOCK_BYTES` of them.

Stacks with few output positions per sample take ``J v`` and ``Jᵀ c`` by ``bmm`` over
their unfolded inputs instead (:mod:`.conv_stack_bmm`, chosen by the group).
Transposed convolutions are not stacked (their Grams swap the roles of ``I`` and ``G``).
All results are unscaled: the caller multiplies by the per-sample scale ``k``.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..capture.match import LayerSpec
from ..capture.per_sample_conv import per_sample_conv_weight_grads
from . import materialized
from .conv import unfold
from .tensors import DEFAULT_BLOCK_BYTES, gram_factor_stacked

__all__ = ["jvp", "vjp", "gram", "channel_sums", "STACK_BLOCK_BYTES"]

STACK_BLOCK_BYTES = 512 * 2**20
"""Bound on the per-sample gradients made at once by the ``"materialize"`` Gram; beyond
:data:`STACK_BLOCK_FLOOR` also by the bytes of the stack's own ``I, G``."""
STACK_BLOCK_FLOOR = 32 * 2**20


def _geometry(spec: LayerSpec, L: int) -> tuple[list[int], list[int], list[int], bool, list[int], int]:
    nd = spec.weight.dim() - 2
    return list(spec.stride), list(spec.padding), list(spec.dilation), False, [0] * nd, L * spec.groups


def _stacked_weight_shape(spec: LayerSpec, L: int) -> tuple[int, ...]:
    w = spec.weight.shape
    return (L * w[0], *w[1:])


def jvp(spec: LayerSpec, I: Tensor, G: Tensor, vw: Tensor, vb: Optional[Tensor]) -> Tensor:
    """``J v`` of every layer, ``[L, m]``, for ``v = (vw [L, n_w], vb [L, c_out] or None)``."""
    m, L = I.shape[:2]
    W = vw.to(I.dtype).reshape(_stacked_weight_shape(spec, L))
    b = vb.to(I.dtype).reshape(-1) if vb is not None else None
    y = torch.ops.aten.convolution(I.flatten(1, 2), W, b, *_geometry(spec, L))  # [m, L·c_out, *sp]
    return (y.reshape(m, L, -1) * G.reshape(m, L, -1)).sum(2).T


def vjp(spec: LayerSpec, I: Tensor, G: Tensor, c: Tensor) -> tuple[Tensor, Tensor]:
    """``Jᵀ c`` of every layer for ``c [L, m]``: ``(w [L, n_w], b [L, c_out])``."""
    m, L = I.shape[:2]
    Gc = G * c.T.to(G.dtype).reshape(m, L, *([1] * (G.dim() - 2)))
    shape = _stacked_weight_shape(spec, L)
    _, gW, gb = torch.ops.aten.convolution_backward(
        Gc.flatten(1, 2), I.flatten(1, 2), I.new_empty(shape), [shape[0]], *_geometry(spec, L),
        [False, True, True])
    return gW.reshape(L, -1), gb.reshape(L, -1)


def channel_sums(spec: LayerSpec, I: Tensor, G: Tensor, rows: Tensor) -> tuple[Tensor, Tensor]:
    """``Jᵀ1`` of every layer (unscaled) at a few output channels, by ONE weight-gradient
    convolution over those channels only: ``rows [n_r]`` (channels within a group, in
    ``[0, c_out/g)``) are taken in every group ``j`` (output channels ``j·c_out/g + rows``).
    Returns ``(sums [L, g·n_r, c_in/g·Πk], channels [g·n_r])``: row ``t`` of a layer is its
    weight gradient's output channel ``channels[t]``. Costs ``g·n_r / c_out`` of the full
    ``Jᵀ1`` (:func:`vjp` with ``c = 1``)."""
    m, L = I.shape[:2]
    g, c_out = spec.groups, spec.weight.shape[0]
    channels = rows if g == 1 else (torch.arange(g, device=rows.device).unsqueeze(1) * (c_out // g) + rows).reshape(-1)
    Gs = G.index_select(2, channels)  # [m, L, g·n_r, *sp_out]: group j's channels j-th, as the weight's
    shape = (L * channels.shape[0], *spec.weight.shape[1:])
    _, gW, _ = torch.ops.aten.convolution_backward(
        Gs.flatten(1, 2), I.flatten(1, 2), I.new_empty(shape), None, *_geometry(spec, L), [False, True, False])
    return gW.reshape(L, channels.shape[0], -1), channels


def bias_sums(G: Tensor) -> Tensor:
    """Per-sample bias gradients ``Σ_t G[:, l, :, t]``, ``[L, m, c_out]``."""
    return G.flatten(3).sum(3).transpose(0, 1)


def gram(spec: LayerSpec, I: Tensor, G: Tensor, how: str, has_bias: bool,
         block_bytes: int = DEFAULT_BLOCK_BYTES) -> Tensor:
    """``J Jᵀ`` of every layer, ``[L, m, m]`` (``how``: ``"factor"`` or ``"materialize"``)."""
    K = _gram_factor(spec, I, G, block_bytes) if how == "factor" else _gram_materialize(spec, I, G)
    if has_bias:
        db = bias_sums(G)
        K = torch.baddbmm(K, db, db.transpose(1, 2))
    return K


def _gram_factor(spec: LayerSpec, I: Tensor, G: Tensor, block_bytes: int) -> Tensor:
    """Positions form: ``A [L, g, m, S, f]`` of the unfolded inputs, ``B [L, g, m, S, o]``."""
    m, L = I.shape[:2]
    g = spec.groups
    w = spec.weight
    cols = unfold(I.flatten(0, 1), tuple(w.shape[2:]), spec.stride, spec.padding, spec.dilation)  # [m·L, S, c·Πk]
    S = cols.shape[1]
    A = cols.reshape(m, L, S, g, -1).permute(1, 3, 0, 2, 4)
    B = G.reshape(m, L, g, -1, S).permute(1, 2, 0, 4, 3)
    return gram_factor_stacked(A, B, block_bytes)


def _gram_materialize(spec: LayerSpec, I: Tensor, G: Tensor) -> Tensor:
    """``P Pᵀ`` per layer, the per-sample gradients of ``Lc`` layers made at a time: at
    most :data:`STACK_BLOCK_BYTES` of them, and beyond :data:`STACK_BLOCK_FLOOR` no more
    than the stack's own ``I, G`` (one layer at least), so the transient ``P`` does not
    outgrow what is kept."""
    m, L = I.shape[:2]
    w = spec.weight
    n = w.numel()
    block = min(STACK_BLOCK_BYTES, max(STACK_BLOCK_FLOOR, I.numel() * I.element_size() + G.numel() * G.element_size()))
    Lc = max(1, min(L, block // max(1, m * n * I.element_size())))
    geo = _geometry(spec, 1)
    parts = []
    for l0 in range(0, L, Lc):
        l1 = min(L, l0 + Lc)
        P = per_sample_conv_weight_grads(G[:, l0:l1].flatten(0, 1), I[:, l0:l1].flatten(0, 1), w.shape,
                                         geo[0], geo[1], geo[2], spec.groups)  # [m·Lc, n], (sample, layer)
        P = P.reshape(m, l1 - l0, n).transpose(0, 1)
        parts.append(materialized.gram(P, None, 1.0))
        del P  # freed before the next chunk's P is made
    return parts[0] if len(parts) == 1 else torch.cat(parts)
