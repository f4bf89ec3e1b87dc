"""Curvature kernel of a bias-only layer: a covered Linear, ConvNd or norm layer whose
weight is frozen and whose bias is trainable (BitFit).

Its capture site (:mod:`..capture.bias`) always records the per-sample bias gradients
``P = [Σ_s G_i[s]]_i`` (``[m, C]``, ``C = bias.numel()``), so, as for added parameters
(:mod:`.param`), the Gram is ``P Pᵀ`` and ``J v``, ``Jᵀ c`` are products with ``P``; this
kernel only sizes them: ``(g, S, f, o) = (1, 1, C, 1)``.
"""
from __future__ import annotations

from ..capture.match import LayerSpec
from .param import jvp, layout, per_sample_grads, vjp

__all__ = ["dims", "layout", "jvp", "vjp", "per_sample_grads"]


def dims(spec: LayerSpec, in_shape: tuple[int, ...]) -> tuple[int, int, int, int]:
    """``(1, 1, bias.numel(), 1)``."""
    return 1, 1, spec.bias.numel(), 1
