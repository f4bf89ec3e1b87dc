"""Which capture sites materialize per-sample gradients in the backward (``store.jacobian_sites``):
the cost model's choice per layer, within the optimizer's ``jacobian_budget`` (bytes, None: each
layer's own bound)."""
from __future__ import annotations

from typing import Literal, Optional, Sequence

from ...curvature.layer import CoveredLayer
from .group_build import initial_sites, kept_sites

__all__ = ["initial_jacobian_sites", "uncaptured_sites", "marked_jacobian_sites"]


def initial_jacobian_sites(layers: Sequence[CoveredLayer], strategy: str, budget: Optional[float],
                           m: int = 128) -> set[int]:
    """Before any capture: the sites of the layers the cost model would materialize at a
    nominal batch ``m`` (:func:`.group_build.initial_sites`), so even the first backward
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
