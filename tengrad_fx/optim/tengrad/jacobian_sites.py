"""Which capture sites materialize per-sample gradients in the backward (``store.jacobian_sites``):
the cost model's choice per layer, within the optimizer's ``jacobian_budget``."""
from __future__ import annotations

from typing import Any

from .group_build import initial_sites, kept_sites

__all__ = ["JacobianSites"]


class JacobianSites:
    """Mixin of :class:`~.tengrad.TENGraD` (reads ``_layers``, ``_info``, ``strategy``,
    ``jacobian_budget``)."""

    _layers: list[Any]
    _info: Any
    strategy: str
    jacobian_budget: Any

    def _initial_jacobian_sites(self, m: int = 128) -> None:
        """Before any capture: the layers the cost model would materialize at a nominal
        batch ``m`` (:func:`.group_build.initial_sites`), so even the first backward
        computes their per-sample gradients; the first curvature step re-decides."""
        self._info.store.jacobian_sites = initial_sites(self._layers, self.strategy, self.jacobian_budget, m)

    def _uncaptured_sites(self) -> set[int]:
        """The materialized sites of layers with no record now: they keep the choice."""
        old = self._info.store.jacobian_sites
        return {s for lay in self._layers if not lay.captured for s in lay.spec.sites if s in old}

    def _mark_jacobian_sites(self) -> None:
        candidates = [(layer, layer.m, [r.in_shape for r in layer.records()]) for layer in self._layers
                      if layer.weight.requires_grad and layer.captured and layer.choose(self.strategy) == "materialize"]
        self._info.store.jacobian_sites = kept_sites(candidates, self._uncaptured_sites(), self.jacobian_budget)
