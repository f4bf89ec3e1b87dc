"""Curvature kernel for ``nn.Linear`` on ``[m, *, d_in]`` inputs.

Positions are all dimensions between the sample and the feature dimension (sequence
tokens, channels-last pixels): ``A = I.reshape(m, 1, S, d_in)``, ``B = G.reshape(m, 1, S, d_out)``.

A transposed Linear (``spec.transposed``: Hugging Face's ``Conv1D``, weight ``[d_in, d_out]``)
records the same ``I``, ``G``; its weight-shaped quantities (``v_w``, ``Jᵀc``'s weight part,
the per-sample gradients ``I_iᵀ G_i``) are in that ``[d_in, d_out]`` layout. The Gram does
not depend on the layout.
"""
from __future__ import annotations

from typing import Optional

from torch import Tensor

from ..capture.match import LayerSpec
from . import tensors

__all__ = ["layout", "dims", "jvp", "vjp", "per_sample_grads"]


def layout(spec: LayerSpec, I: Tensor, G: Tensor) -> tuple[Tensor, Tensor]:
    """``(A [m, 1, S, d_in], B [m, 1, S, d_out])``."""
    m = I.shape[0]
    return I.reshape(m, 1, -1, I.shape[-1]), G.reshape(m, 1, -1, G.shape[-1])


def dims(spec: LayerSpec, in_shape: tuple[int, ...]) -> tuple[int, int, int, int]:
    """``(g, S, f, o)`` for an input of shape ``in_shape``."""
    S = 1
    for d in in_shape[1:-1]:
        S *= d
    return 1, S, in_shape[-1], spec.weight.shape[1 if spec.transposed else 0]


def jvp(spec: LayerSpec, I: Tensor, G: Tensor, vW: Tensor, vb: Optional[Tensor]) -> Tensor:
    """``J v`` for ``v = (vW [d_out, d_in] (transposed: [d_in, d_out]), vb [d_out])``, ``[m]``."""
    A, B = layout(spec, I, G)
    if spec.transposed:
        vW = vW.t()
    return tensors.jvp(A, B, vW.unsqueeze(0), None if vb is None else vb.unsqueeze(0))


def vjp(spec: LayerSpec, I: Tensor, G: Tensor, c: Tensor) -> tuple[Tensor, Tensor]:
    """``Jᵀ c`` as ``(weight [d_out, d_in] (transposed: [d_in, d_out]), bias [d_out])``."""
    A, B = layout(spec, I, G)
    gW, gb = tensors.vjp(A, B, c)
    return (gW[0].t() if spec.transposed else gW[0]), gb[0]


def per_sample_grads(spec: LayerSpec, I: Tensor, G: Tensor) -> tuple[Tensor, Tensor]:
    """``(dW [m, d_out·d_in] (transposed: [m, d_in·d_out]), db [m, d_out])``: one batched
    matmul over positions."""
    A, B = layout(spec, I, G)
    dW, db = tensors.per_sample_grads(A, B)
    if spec.transposed:
        dW = dW.transpose(-1, -2)
    return dW.flatten(1), db.flatten(1)
