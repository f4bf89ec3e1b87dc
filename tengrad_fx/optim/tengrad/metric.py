"""``TENGraD(..., metric=...)``: a base metric ``D`` inside the damping, ``u = (F + αD)⁻¹ g``,
still exact by Woodbury through the change of variables ``S = D^{-1/2}`` of
:mod:`.metric_scaling`. :func:`make_metric` reads the option: ``"factored"`` (here) or
``"kronecker"`` (:mod:`.kronecker_metric`), as a string (the moments' EMA factor
``beta2 = 0.99``, ``root_every="auto"``) or as :class:`Metric` (the kind, its ``beta2`` and
``root_every``, how often ``S`` is recomputed between curvature steps: by default every 5
steps for ``"kronecker"``, never for ``"factored"``, :data:`ROOT_EVERY`).

``metric="factored"``: ``D`` of a weight ``W [R, C]`` is Kronecker-diagonal, ``D = a ⊗ b``,
from factored second moments as Adafactor keeps them: EMAs (``beta2``) over steps of the row
means ``r [R]`` and column means ``c [C]`` of ``g²``; ``√(r cᵀ / mean(r))`` normalized to
mean 1 is ``a_i b_j`` with ``a = √r / mean(√r)`` and ``b = √c / mean(√c)``, each floored at
:data:`FLOOR`. Mean 1 keeps ``α`` on its usual scale; directions the rows do not span get
``g / (α D)``, Adafactor's step divided by ``α``.

State of each covered weight: ``metric_rows`` ``[R]``, ``metric_cols`` ``[C]``, and the fixed
``metric_scale_rows`` / ``metric_scale_cols`` (``S``'s factors). Reuse steps replay as CUDA
graphs as before; curvature steps take the modular path (no fused update under ``compile``).
``DistributedTENGraD`` under DDP runs it as here: the moments come from the averaged gradient
(the same on every rank), and each rank scales its own records before they move
(docs/distributed.md); under FSDP2 each rank keeps the whole moments and forms its rows of
``S g`` (:mod:`tengrad_fx.distributed.fsdp_metric`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Optional, Union

import torch
from torch import Tensor

from ...curvature.layer import CoveredLayer
from .kronecker_metric import KroneckerMetric
from .metric_scaling import ScaledMetric, ema_finite_, metric_covers

__all__ = ["FactoredMetric", "FLOOR", "METRICS", "ROOT_EVERY", "Metric", "MetricOption", "make_metric", "metric_covers"]

FLOOR = 1e-3  # the least of a and b (relative to their mean 1)
METRICS = ("factored", "kronecker")
ROOT_EVERY: dict[str, Optional[int]] = {"factored": None, "kronecker": 5}
"""Each kind's ``Metric.root_every="auto"``: the best of ``None, 20, 10, 5`` on
GPT-2 bytes for the Kronecker metric (docs/ablations.md); the factored one's as measured
for the ``lm`` preset (fixed between curvature steps)."""


@dataclass(frozen=True)
class Metric:
    """TENGraD's ``metric=`` with its options: ``Metric("factored", beta2=0.9)``.

    Attributes:
        kind: ``"factored"`` or ``"kronecker"`` (module docstring).
        beta2: the EMA factor of the metric's second moments, in ``[0, 1)``.
        root_every: ``k``: ``S = D^{-1/2}`` (the roots of the moments) is also recomputed on
            every ``k``-th step after a curvature step, and the Grams of the kept rows rebuilt
            and refactorized under it: a Gram and a Cholesky per layer, no backward, no capture
            (:meth:`~.metric_scaling.ScaledMetric.refresh_roots`; such a step runs eagerly, with
            the eigensolver's host reads). None: ``S`` fixed between curvature steps.
            ``"auto"``: the kind's :data:`ROOT_EVERY`.
    """

    kind: Literal["factored", "kronecker"]
    beta2: float = 0.99
    root_every: Union[int, None, Literal["auto"]] = "auto"

    def __post_init__(self) -> None:
        if self.kind not in METRICS:
            raise ValueError(f"TENGraD: metric must be None, {', '.join(repr(m) for m in METRICS)}, got "
                             f"{self.kind!r} (or Metric(kind, beta2=...) of one of them)")
        if not (isinstance(self.beta2, (int, float)) and 0.0 <= self.beta2 < 1.0):
            raise ValueError(f"Metric.beta2 must be in [0, 1), got {self.beta2!r}")
        every = self.root_every
        if every not in (None, "auto") and (isinstance(every, bool) or not isinstance(every, int) or every < 1):
            raise ValueError(f"Metric.root_every must be None, 'auto' or an int >= 1 (steps between "
                             f"recomputations of S), got {every!r}")


MetricOption = Optional[Union[Literal["factored", "kronecker"], Metric]]
"""What ``metric=`` takes: None (``D = I``), a kind (``beta2 = 0.99``) or a :class:`Metric`."""


def make_metric(metric: MetricOption) -> Optional[ScaledMetric]:
    """TENGraD's ``metric`` option: None (``D = I``), ``"factored"``, ``"kronecker"`` or a
    :class:`Metric` of one (else ``ValueError`` listing them); ``root_every="auto"`` resolved
    (:data:`ROOT_EVERY`)."""
    if metric is None:
        return None
    spec = metric if isinstance(metric, Metric) else Metric(metric)
    every = spec.root_every
    if every == "auto":
        every = ROOT_EVERY[spec.kind]
    assert every is None or isinstance(every, int)
    return (FactoredMetric if spec.kind == "factored" else KroneckerMetric)(spec.beta2, every)


def _factor(moment: Tensor) -> Tensor:
    """``√moment / mean(√moment)``, floored at :data:`FLOOR`."""
    root = moment.sqrt()
    return (root / root.mean().clamp_min(torch.finfo(root.dtype).tiny)).clamp_min(FLOOR)


class FactoredMetric(ScaledMetric):
    """The Kronecker-diagonal ``D`` of every covered layer (module docstring).

    Args:
        beta2: the second moments' EMA factor, in ``[0, 1)``.
    """

    MOMENTS = ("metric_rows", "metric_cols")
    SCALES = ("metric_scale_rows", "metric_scale_cols")

    def observe(self, state: Any, layers: list[CoveredLayer]) -> None:
        """Fold this step's ``g²`` row and column means into each covered weight's EMAs."""
        for lay in layers:
            w = lay.weight
            if not metric_covers(lay) or w.grad is None:
                continue
            st, g2 = state[w], w.grad.square()
            if "metric_rows" not in st:
                st["metric_rows"] = torch.zeros(w.shape[0], dtype=w.dtype, device=w.device)
                st["metric_cols"] = torch.zeros(w.shape[1], dtype=w.dtype, device=w.device)
            ema_finite_(st["metric_rows"], self.beta2, g2.mean(1))
            ema_finite_(st["metric_cols"], self.beta2, g2.mean(0))

    def side_scales(self, moments: list[Tensor]) -> list[Tensor]:
        """``(a or b)^{-1/2}`` of each moment."""
        return [_factor(moment).rsqrt() for moment in moments]
