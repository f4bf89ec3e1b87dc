"""Which capture sites materialize per-sample gradients in the backward (``store.jacobian_sites``):
the cost model's choice per layer, within the optimizer's ``jacobian_budget`` (bytes, None: each
layer's own bound).

Which materialized layers keep ``J`` (:func:`keeps_jacobian`): by default each layer
whose ``J`` is at most ``min(4, S/8)`` times its own ``I, G`` (``S`` positions per sample,
at least 1×: :func:`default_jacobian_cap`), since a kept ``J`` makes a reuse step's products
``S×`` cheaper; so the kept records are at most 4× those of an all-factored model. With a
number (``jacobian_budget_mb``) every one within it.
"""
from __future__ import annotations

import math
from typing import Literal, Optional, Sequence

from ...curvature.layer import KERNELS, CoveredLayer, choose_strategy

__all__ = ["JACOBIAN_RATIO_MAX", "POSITIONS_PER_RATIO", "default_jacobian_cap", "factored_bytes",
           "initial_jacobian_sites", "initial_sites", "keeps_jacobian", "kept_sites", "marked_jacobian_sites",
           "uncaptured_sites"]

JACOBIAN_RATIO_MAX, POSITIONS_PER_RATIO = 4.0, 8  # default_jacobian_cap: J ≤ min(4, S/8)·(I, G)


def factored_bytes(layer: CoveredLayer, in_shapes: list[tuple[int, ...]], itemsize: int) -> int:
    """Bytes of the layer's ``I`` and ``G`` for calls with inputs ``in_shapes`` (batch
    first): what keeping the layer factored costs (``I`` = the input, ``G`` ``m·g·S·o``)."""
    total = 0
    for shape in in_shapes:
        g, S, _, o = layer._kernel.dims(layer.spec, shape)
        total += math.prod(shape) + shape[0] * g * S * o
    return total * itemsize


def default_jacobian_cap(layer: CoveredLayer, in_shapes: list[tuple[int, ...]], itemsize: int) -> float:
    """The most bytes a materialized layer's ``J`` may take and be kept by default: its
    ``I, G``'s bytes (:func:`factored_bytes`) times ``min(JACOBIAN_RATIO_MAX, S / POSITIONS_PER_RATIO)``,
    at least 1, with ``S`` its positions per sample over all calls. Kept, ``J g`` and
    ``Jᵀ c`` cost ``2·m·n`` flops each on a reuse step; from ``I, G`` they cost about
    ``2·m·S·n`` (a Linear over a sequence, a convolution over its output map), ``S×`` more."""
    S = sum(layer._kernel.dims(layer.spec, shape)[1] for shape in in_shapes)
    ratio = min(JACOBIAN_RATIO_MAX, max(1.0, S / POSITIONS_PER_RATIO))
    return ratio * factored_bytes(layer, in_shapes, itemsize)


def keeps_jacobian(p_bytes: int, cap: float, budget: Optional[float]) -> bool:
    """Whether a layer the cost model materializes keeps its ``J`` (``p_bytes``) between
    steps: within the bytes left of a flat ``budget``, or, with ``budget=None`` (TENGraD's
    default), within the layer's own ``cap`` (:func:`default_jacobian_cap`)."""
    return p_bytes <= (cap if budget is None else budget)


def kept_sites(candidates: list[tuple[CoveredLayer, int, list[tuple[int, ...]]]], sites: set[int],
               budget: Optional[float]) -> set[int]:
    """``sites`` plus the call sites of the ``(layer, m, input shapes)`` the cost model
    materializes (in layer order) that keep ``J`` between steps (:func:`keeps_jacobian`
    under ``budget`` bytes, shared in that order; None: no bound)."""
    for layer, m, shapes in candidates:
        es = layer.weight.element_size()
        nbytes = m * sum(p.numel() for p in (layer.weight, layer.bias) if p is not None) * es
        if keeps_jacobian(nbytes, default_jacobian_cap(layer, shapes, es), budget):
            budget = None if budget is None else budget - nbytes
            sites.update(layer.spec.sites)
    return sites


def initial_sites(layers: list[CoveredLayer], strategy: str, budget: Optional[float], m: int = 128) -> set[int]:
    """The call sites of the ``layers`` the cost model would materialize at a nominal
    batch ``m`` (from the shapes ``prepare`` probed), within ``budget``: what the backward
    materializes before the first curvature step re-decides with the real batch."""
    candidates = []
    for layer in layers:
        spec = layer.spec
        if not spec.input_shapes or strategy == "factor" or not getattr(KERNELS[spec.kind], "MATERIALIZE", True):
            continue
        shapes = [(m, *shape[1:]) for shape in spec.input_shapes]
        g = S = f = o = 0
        for shape in shapes:
            g, s_, f, o = KERNELS[spec.kind].dims(spec, shape)
            S += s_
        if strategy == "materialize" or choose_strategy(m, g, S, f, o) == "materialize":
            candidates.append((layer, m, shapes))
    return kept_sites(candidates, set(), budget)


def initial_jacobian_sites(layers: Sequence[CoveredLayer], strategy: str, budget: Optional[float],
                           m: int = 128) -> set[int]:
    """Before any capture: the sites of the layers the cost model would materialize at a
    nominal batch ``m`` (:func:`initial_sites`), so even the first backward
    computes their per-sample gradients; the first curvature step re-decides."""
    return initial_sites(list(layers), strategy, budget, m)


def uncaptured_sites(layers: Sequence[CoveredLayer], current: set[int]) -> set[int]:
    """The sites in ``current`` (the store's materialized sites) of layers with no record
    now: they keep the choice."""
    return {s for lay in layers if not lay.captured for s in lay.spec.sites if s in current}


def marked_jacobian_sites(layers: Sequence[CoveredLayer], strategy: Literal["auto", "factor", "materialize"],
                          budget: Optional[float], current: set[int]) -> set[int]:
    """The sites to materialize from the records now captured (the fused path's choice,
    as the modular path's :func:`.group_build.build_groups` would make it)."""
    candidates: list[tuple[CoveredLayer, int, list[tuple[int, ...]]]] = [
        (layer, layer.m, [r.in_shape for r in layer.records()]) for layer in layers
        if layer.weight.requires_grad and layer.captured and layer.choose(strategy) == "materialize"]
    return kept_sites(candidates, uncaptured_sites(layers, current), budget)
