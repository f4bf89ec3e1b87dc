"""Curvature kernel of added parameters (tokens, position embeddings, layer scales).

Their capture op always records the per-sample gradients ``P [m, p.numel()]``
(:mod:`..capture.params`), so the Gram is ``P Pᵀ`` and ``J v``, ``Jᵀ c`` are products with
``P``; this kernel only sizes them: ``(g, S, f, o) = (1, 1, numel, 1)``.
"""
from __future__ import annotations

from typing import NoReturn

from ..capture.match import LayerSpec

__all__ = ["dims", "layout", "jvp", "vjp", "per_sample_grads"]


def dims(spec: LayerSpec, in_shape: tuple[int, ...]) -> tuple[int, int, int, int]:
    """``(1, 1, p.numel(), 1)``."""
    return 1, 1, spec.weight.numel(), 1


def _recorded_only(*_: object) -> NoReturn:
    raise RuntimeError("added parameters and bias-only layers record their per-sample gradients P; "
                       "there is no I, G form")


layout = jvp = vjp = per_sample_grads = _recorded_only  # never reached: records always hold P
