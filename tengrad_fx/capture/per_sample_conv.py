"""Per-sample weight gradients of a ConvNd / ConvTransposeNd, ``P [m, weight.numel()]``.

Sample ``i``'s weight gradient of a convolution with ``g`` groups is, per group ``j``,
``P_ij = G_ij U_ijᵀ``: ``G_ij [o, S]`` its output gradient (``o = c_out/g`` channels,
``S`` output positions) and ``U_ij [f, S]`` its unfolded input patches (``f = c_in/g·Πk``).
Three ways to compute all ``m·g`` of them, picked per layer (:func:`method_for`):

* ``"grouped"`` — one grouped weight-gradient convolution over the batch folded into the
  channels (``groups = m·g``; aten's/cuDNN's kernel, no unfolded input in memory).
* ``"unfold"`` — ``U`` by ``F.unfold`` (a 1×1 convolution without padding: ``x`` itself,
  strided), then ONE ``bmm`` over ``m·g``: ``[o, S] @ [S, f]`` per sample and group.
* ``"depthwise"`` — ``groups = c_in``: ``f = Πk``, ``o`` = the channel multiplier; per
  sample and channel ``P[i, c, t, κ] = Σ_s G[i, c·o+t, s]·U[i, c, κ, s]``, one batched
  GEMV-shaped ``bmm`` ``[Πk, S] @ [S, o]`` over ``m·c_in`` (no grouped convolution).

Rule (``"auto"``, the default), by the device of the tensors:

* 1×1 Conv1d/2d without padding → ``"unfold"`` (``U`` is the input itself: no im2col,
  and the ``bmm`` is the plain GEMM a weight gradient is; 2× faster than the grouped
  convolution on CPU too);
* on CUDA: depthwise Conv1d/2d → ``"depthwise"``, other grouped Conv1d/2d
  (``1 < g < c_in``) → ``"unfold"``, dense Conv1d/2d with a larger kernel → ``"grouped"``;
* on CPU (and other devices) every other conv → ``"grouped"``;
* every Conv3d and every transposed conv → ``"grouped"``.

Why. CUDA (NVIDIA H200, m = 128): cuDNN runs the grouped
weight-gradient convolution with ``groups = m·g`` as thousands of small kernels, worst for
depthwise and grouped layers (MobileNetV2: ``wgrad2d_grouped_direct_kernel`` plus 4374
``nchwToNhwc`` layout conversions per step). Unfold + ``bmm`` for every Conv2d made
MobileNetV2's T=1 step 7.21× SGD's instead of 8.22×, but WRN-28-4's (dense 3×3
convolutions) 5.71× instead of 5.03×: for a dense k×k convolution the im2col copy (``Πk``×
the input) costs more than cuDNN saves, so those keep the grouped convolution. CPU (2
threads, m = 32; ``F.unfold`` is slow there and a batched GEMM of many tiny matrices loops
per matrix): depthwise 144 channels at 16×16: grouped 3.2 ms, unfold + ``bmm`` 19.5 ms;
960 channels at 4×4: 0.19 vs 3.1 ms; a 1×1 convolution 144→24 at 16×16: grouped 0.76 ms,
``bmm`` 0.38 ms.
1d goes through the 2d code (a height-1 image); 3d has no ``F.unfold`` and keeps
``"grouped"``. ``TENGRAD_FX_PER_SAMPLE_CONV=grouped|unfold`` (environment, or
:func:`per_sample_conv_method` in code) overrides the rule for every layer on every
device (``unfold``: depthwise layers take the ``"depthwise"`` form; 3d and transposed
convs still fall back to ``"grouped"``, which has the only form there).

Memory: ``"unfold"``/``"depthwise"`` hold ``U`` (``m·c_in·Πk·S`` elements; for a 1×1
stride-1 convolution none) in chunks of samples of at most :data:`UNFOLD_BLOCK_BYTES`.
"""
from __future__ import annotations

import contextlib
import os
from typing import Iterator, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["per_sample_conv_weight_grads", "method_for", "per_sample_conv_method", "METHODS"]

METHODS = ("auto", "grouped", "unfold")
PER_SAMPLE_CONV: str = os.environ.get("TENGRAD_FX_PER_SAMPLE_CONV", "auto")
if PER_SAMPLE_CONV not in METHODS:
    raise ValueError(f"TENGRAD_FX_PER_SAMPLE_CONV={PER_SAMPLE_CONV!r}: use one of {METHODS}")
UNFOLD_BLOCK_BYTES = 512 * 2**20
"""Bound on the unfolded input ``U`` held at once (larger batches go in sample chunks)."""


@contextlib.contextmanager
def per_sample_conv_method(method: str) -> Iterator[None]:
    """Inside: every per-sample conv gradient uses ``method`` (``"auto"``, ``"grouped"``,
    ``"unfold"``), as ``TENGRAD_FX_PER_SAMPLE_CONV`` would (e.g. to compare in one process)."""
    global PER_SAMPLE_CONV
    if method not in METHODS:
        raise ValueError(f"per-sample conv method {method!r}: use one of {METHODS}")
    old, PER_SAMPLE_CONV = PER_SAMPLE_CONV, method
    try:
        yield
    finally:
        PER_SAMPLE_CONV = old


def method_for(weight_shape: Sequence[int], groups: int, padding: Sequence[int],
               transposed: bool = False, device_type: str = "cpu", mode: Optional[str] = None) -> str:
    """``"grouped"``, ``"unfold"`` or ``"depthwise"`` for a convolution with weight
    ``[c_out, c_in/g, *k]`` on a ``device_type`` device (module docstring); ``mode``
    defaults to the global setting."""
    mode = PER_SAMPLE_CONV if mode is None else mode
    nd = len(weight_shape) - 2
    if transposed or nd > 2 or mode == "grouped":
        return "grouped"
    depthwise = weight_shape[1] == 1 and groups > 1  # c_in/g == 1
    pointwise = all(k == 1 for k in weight_shape[2:]) and not any(padding)
    if mode == "unfold" or (device_type == "cuda" and groups > 1):
        return "depthwise" if depthwise else "unfold"
    return "unfold" if pointwise else "grouped"


def per_sample_conv_weight_grads(
    grad: Tensor, x: Tensor, weight_shape: Sequence[int], stride: Sequence[int],
    padding: Sequence[int], dilation: Sequence[int], groups: int, *,
    transposed: bool = False, output_padding: Optional[Sequence[int]] = None,
) -> Tensor:
    """Per-sample weight gradients, ``[m, weight.numel()]`` (method by :func:`method_for`).

    x: ``[m, c_in, *spatial]``; grad: ``[m, c_out, *spatial_out]``; the weight is
    ``[c_out, c_in/g, *k]``, or ``[c_in, c_out/g, *k]`` when ``transposed``.
    """
    how = method_for(weight_shape, groups, padding, transposed, x.device.type)
    if how == "grouped":
        return _grouped(grad, x, weight_shape, stride, padding, dilation, groups, transposed, output_padding)
    if len(weight_shape) == 3:  # Conv1d as a height-1 Conv2d
        x, grad = x.unsqueeze(2), grad.unsqueeze(2)
        weight_shape = (*weight_shape[:2], 1, weight_shape[2])
        stride, padding, dilation = (1, stride[0]), (0, padding[0]), (1, dilation[0])
    m = x.shape[0]
    per_sample = x[0].numel() * weight_shape[2] * weight_shape[3] * x.element_size()
    chunk = max(1, min(m, UNFOLD_BLOCK_BYTES // max(1, per_sample)))
    parts = [_unfold_bmm(grad[i:i + chunk], x[i:i + chunk], weight_shape, stride, padding, dilation,
                         groups, how == "depthwise") for i in range(0, m, chunk)]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _grouped(grad: Tensor, x: Tensor, weight_shape: Sequence[int], stride: Sequence[int],
             padding: Sequence[int], dilation: Sequence[int], groups: int, transposed: bool,
             output_padding: Optional[Sequence[int]]) -> Tensor:
    """One grouped weight-gradient convolution with ``groups = m·g``, ``[m, n]``."""
    m = x.shape[0]
    nd = len(weight_shape) - 2
    xs = x.reshape(1, -1, *x.shape[2:])
    gs = grad.reshape(1, -1, *grad.shape[2:])
    w = x.new_empty((m * weight_shape[0], *weight_shape[1:]))
    op = list(output_padding) if output_padding is not None else [0] * nd
    gw = torch.ops.aten.convolution_backward.default(
        gs, xs, w, None, list(stride), list(padding), list(dilation), transposed, op, m * groups,
        [False, True, False])[1]
    return gw.reshape(m, -1)


def _patches(x: Tensor, kernel: Sequence[int], stride: Sequence[int], padding: Sequence[int],
             dilation: Sequence[int]) -> Tensor:
    """``U [m, c_in·Πk, S]`` of a 2d input ``x [m, c_in, H, W]`` (``F.unfold``'s layout); a
    1×1 kernel without padding takes ``x`` itself (strided)."""
    if all(k == 1 for k in kernel) and not any(padding):
        return x[:, :, ::stride[0], ::stride[1]].flatten(2)
    return F.unfold(x, tuple(kernel), dilation=tuple(dilation), padding=tuple(padding), stride=tuple(stride))


def _unfold_bmm(grad: Tensor, x: Tensor, weight_shape: Sequence[int], stride: Sequence[int],
                padding: Sequence[int], dilation: Sequence[int], groups: int, depthwise: bool) -> Tensor:
    """Conv2d per-sample weight gradients by ONE ``bmm`` over ``m·g``, ``[m, n]``.

    ``U [m·g, f, S]`` (``f = c_in/g·kh·kw``), ``G [m·g, o, S]``: ``P = G Uᵀ`` per sample and
    group (``[o, f]``); ``depthwise`` (``f = kh·kw``, ``o`` = multiplier): ``P = (U Gᵀ)ᵀ``,
    a GEMV per sample and channel when ``o = 1`` (the transpose is then a free view)."""
    m, g = x.shape[0], groups
    o = weight_shape[0] // g
    U = _patches(x, weight_shape[2:], stride, padding, dilation)
    S = U.shape[2]
    Us = U.reshape(m * g, -1, S)  # [m·g, f, S]
    Gs = grad.reshape(m * g, o, S)  # [m·g, o, S]
    if depthwise:
        return torch.bmm(Us, Gs.transpose(1, 2)).transpose(1, 2).reshape(m, -1)
    return torch.bmm(Gs, Us.transpose(1, 2)).reshape(m, -1)
