"""Curvature kernel for the affine part of norm layers (``y = γ ⊙ x̂ + β``).

Each of the ``C`` affine parameters is its own group of a one-input, one-output linear
layer whose positions are the elements it scales: ``A = x̂``, ``B = G`` in the
``[m, g=C, S, 1]`` layout of :mod:`.tensors` (channel-first kinds: ``x̂ [m, C, *spatial]``;
trailing kinds: ``x̂ [m, *positions, *normalized_shape]``; see :mod:`..capture.norm`). Per sample
``dγ_i = Σ_s G_i[s] ⊙ x̂_i[s]`` and ``dβ_i = Σ_s G_i[s]``, ``[m, C]``.

The cost model sees ``(g, S, f, o) = (C, S, 1, 1)``: materializing ``P`` (``[m, C]``,
``2·m·S·C + 2·m²·C`` flops) is cheaper than the positions form (``4·m²·S²·C``) for every
``S ≥ 1``, so ``auto`` materializes; ``factor`` gives the positions form.
"""
from __future__ import annotations

from typing import Optional

from torch import Tensor

from ..capture.match import LayerSpec
from ..capture.norm import CHANNEL_FIRST
from ..capture.norm_ops import per_sample_sums
from . import tensors

__all__ = ["layout", "dims", "jvp", "vjp", "per_sample_grads"]


def layout(spec: LayerSpec, I: Tensor, G: Tensor) -> tuple[Tensor, Tensor]:
    """``(A [m, C, S, 1], B [m, C, S, 1])`` from ``x̂`` and ``G`` (same shape)."""
    m, C = I.shape[0], spec.weight.numel()
    if spec.kind in CHANNEL_FIRST:
        return I.reshape(m, C, -1, 1), G.reshape(m, C, -1, 1)
    return (I.reshape(m, -1, C).transpose(1, 2).unsqueeze(-1),
            G.reshape(m, -1, C).transpose(1, 2).unsqueeze(-1))


def dims(spec: LayerSpec, in_shape: tuple[int, ...]) -> tuple[int, int, int, int]:
    """``(C, S, 1, 1)`` for an input of shape ``in_shape``."""
    C = spec.weight.numel()
    n = 1
    for d in in_shape[1:]:
        n *= d
    return C, n // C, 1, 1


def jvp(spec: LayerSpec, I: Tensor, G: Tensor, vW: Tensor, vb: Optional[Tensor]) -> Tensor:
    """``J v`` for ``v = (vW [weight shape], vb [C])``, ``[m]``."""
    Pw, Pb = per_sample_grads(spec, I, G)
    out = Pw @ vW.reshape(-1)
    return out if vb is None else out + Pb @ vb.reshape(-1)


def vjp(spec: LayerSpec, I: Tensor, G: Tensor, c: Tensor) -> tuple[Tensor, Tensor]:
    """``Jᵀ c`` as ``(weight part [C], bias part [C])``."""
    A, B = layout(spec, I, G)
    gW, gb = tensors.vjp(A, B, c)
    return gW.reshape(-1), gb.reshape(-1)


def per_sample_grads(spec: LayerSpec, I: Tensor, G: Tensor) -> tuple[Tensor, Tensor]:
    """``(dγ [m, C], dβ [m, C])``: elementwise product, summed over each sample's positions."""
    C, cf = spec.weight.numel(), spec.kind in CHANNEL_FIRST
    return per_sample_sums(G * I, C, cf), per_sample_sums(G, C, cf)
