"""``TENGraD(..., metric="factored")``: a base metric ``D`` inside the damping.

The update of a layer is ``u = (F + αD)⁻¹ g`` with a positive diagonal ``D`` in place of
the identity. With ``S = D^{-1/2}``,

    u = S (S F S + αI)⁻¹ S g,

and ``S F S`` is the Fisher of the rows ``J S``: the plain step's Woodbury solve, run on the
records scaled by ``S`` (:meth:`FactoredMetric.freeze`, :func:`scale_record`) and on ``S g``
(:meth:`FactoredMetric.scaled_grads`), gives ``S⁻¹ u`` (:meth:`FactoredMetric.unscale`).
So the inverse stays exact for the chosen ``D``; only the ``m`` directions the rows span
see the curvature, and every other direction gets ``g / (α D)`` instead of SGD's ``g / α``.

``D`` of a weight ``W [R, C]`` is Kronecker-diagonal, ``D = a ⊗ b``, from factored second
moments as Adafactor keeps them: EMAs (``beta2``) over steps of the row means
``r [R]`` and column means ``c [C]`` of ``g²``; ``√(r cᵀ / mean(r))`` normalized to mean 1
is ``a_i b_j`` with ``a = √r / mean(√r)`` and ``b = √c / mean(√c)``, each floored at
:data:`FLOOR`. Mean 1 keeps ``α`` on its usual scale. In record terms (``I`` the inputs,
``G`` the output gradients of a Linear): ``I`` is scaled by the input side's ``S`` and
``G`` by the output side's, so the Gram keeps its factor form
``(I S_in² Iᵀ) ⊙ (G S_out² Gᵀ)``. The bias ``[d_out]`` gets the output side's factor.

Covered: Linear weights (``[d_out, d_in]``, a transposed Linear's ``[d_in, d_out]``, a
table tied to a Linear, whose lookups are recorded as Linear calls) and Embedding tables
(``[vocab, D]``: ``I`` holds indices, ``G [m, *, D]``). Other layers keep ``D = I``.

``D`` is fixed at each curvature step (the cached factors are those of ``S F S`` with that
``S``); the moments are updated on every step, on the device. They live in the optimizer's
state of each weight (``metric_rows`` ``[R]``, ``metric_cols`` ``[C]``, and the fixed
``metric_scale_rows`` / ``metric_scale_cols``: ``S``'s factors), so ``state_dict`` keeps them.
Reuse steps replay as CUDA graphs as before; curvature steps take the modular path (no fused
update under ``compile``). One process only (``DistributedTENGraD`` refuses it).
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator, Optional

import torch
from torch import Tensor

from ...capture.store import Record
from ...curvature.layer import CoveredLayer
from ..step.result import StepResult

__all__ = ["FactoredMetric", "FLOOR", "make_metric", "metric_covers"]

FLOOR = 1e-3  # the least of a and b (relative to their mean 1)


def metric_covers(layer: CoveredLayer) -> bool:
    """Whether ``layer``'s weight gets a factored ``D`` (Linear or Embedding, 2-D weight)."""
    return not layer.bias_only and layer.kind in ("linear", "embedding") and layer.weight.ndim == 2


def make_metric(metric: Optional[str], beta2: float) -> Optional["FactoredMetric"]:
    """TENGraD's ``metric`` option: None (``D = I``) or ``"factored"`` (else ``ValueError``)."""
    if metric is None:
        return None
    if metric != "factored":
        raise ValueError(f"TENGraD: metric must be None or 'factored', got {metric!r}")
    return FactoredMetric(beta2)


def _factor(moment: Tensor) -> Tensor:
    """``√moment / mean(√moment)``, floored at :data:`FLOOR`."""
    root = moment.sqrt()
    return (root / root.mean().clamp_min(torch.finfo(root.dtype).tiny)).clamp_min(FLOOR)


class FactoredMetric:
    """The factored ``D`` of every covered layer and its change of variables (module docstring).

    Args:
        beta2: the second moments' EMA factor, in ``[0, 1)``.
    """

    def __init__(self, beta2: float = 0.99):
        if not 0.0 <= beta2 < 1.0:
            raise ValueError(f"metric_beta2 must be in [0, 1), got {beta2}")
        self.beta2 = beta2
        self._scaled: dict[int, Record] = {}  # id -> record, the records scaled at the last curvature step

    # ------------------------------------------------------------------ moments and S
    def observe(self, state: Any, layers: list[CoveredLayer]) -> None:
        """Fold this step's ``g²`` row and column means into each covered weight's EMAs."""
        b2 = self.beta2
        for lay in layers:
            w = lay.weight
            if not metric_covers(lay) or w.grad is None:
                continue
            st, g2 = state[w], w.grad.square()
            if "metric_rows" not in st:
                st["metric_rows"] = torch.zeros(w.shape[0], dtype=w.dtype, device=w.device)
                st["metric_cols"] = torch.zeros(w.shape[1], dtype=w.dtype, device=w.device)
            st["metric_rows"].mul_(b2).add_(g2.mean(1), alpha=1.0 - b2)
            st["metric_cols"].mul_(b2).add_(g2.mean(0), alpha=1.0 - b2)

    @staticmethod
    def scales(state: Any, layer: CoveredLayer) -> Optional[tuple[Tensor, Tensor]]:
        """``(s_rows [R], s_cols [C])``: ``S``'s factors fixed at the last curvature step
        (None: ``D = I`` for this layer)."""
        st = state.get(layer.weight, {}) if metric_covers(layer) else {}
        if "metric_scale_rows" not in st:
            return None
        return st["metric_scale_rows"], st["metric_scale_cols"]

    def freeze(self, state: Any, layers: list[CoveredLayer]) -> None:
        """On a curvature step: fix ``S = (a ⊗ b)^{-1/2}`` from the moments and scale the new
        records of every covered layer by it (records scaled before keep theirs, and their ``S``)."""
        scaled: dict[int, Record] = {}
        for lay in layers:
            if not metric_covers(lay) or not lay.captured or "metric_rows" not in state[lay.weight]:
                continue
            recs = lay.records()
            if all(self._scaled.get(id(r)) is r for r in recs):
                scaled.update({id(r): r for r in recs})
                continue
            st = state[lay.weight]
            for key, moment in (("metric_scale_rows", st["metric_rows"]), ("metric_scale_cols", st["metric_cols"])):
                s = _factor(moment).rsqrt()
                if key in st and st[key].shape == s.shape:
                    st[key].copy_(s)  # in place: a captured CUDA graph reads the same storage
                else:
                    st[key] = s
            s_rows, s_cols = st["metric_scale_rows"], st["metric_scale_cols"]
            for r in recs:
                scale_record(lay, r, s_rows, s_cols)
                scaled[id(r)] = r
        self._scaled = scaled

    # ------------------------------------------------------------------ change of variables
    def _pairs(self, state: Any, layers: list[CoveredLayer]) -> Iterator[tuple[CoveredLayer, Tensor, Tensor]]:
        for lay in layers:
            s = self.scales(state, lay)
            if s is not None:
                yield lay, s[0], s[1]

    @contextmanager
    def scaled_grads(self, state: Any, layers: list[CoveredLayer]) -> Iterator[None]:
        """Within: each covered weight's (and bias's) ``.grad`` is ``S g``; restored after."""
        saved: list[tuple[Tensor, Tensor]] = []
        try:
            for lay, s_rows, s_cols in self._pairs(state, layers):
                w, b = lay.weight, lay.bias
                if w.grad is not None:
                    saved.append((w, w.grad))
                    w.grad = w.grad * _weight_side(s_rows, s_cols)
                if b is not None and b.grad is not None:
                    saved.append((b, b.grad))
                    b.grad = b.grad * _out_side(lay, s_rows, s_cols)
            yield
        finally:
            for p, g in saved:
                p.grad = g

    def unscale(self, state: Any, layers: list[CoveredLayer], result: StepResult) -> StepResult:
        """``u = S ũ`` for the covered weights and biases in ``result.updates``; the step's
        ``Σ u·g`` is unchanged (``ũ·(S g) = u·g``)."""
        updates = dict(result.updates)
        for lay, s_rows, s_cols in self._pairs(state, layers):
            w, b = lay.weight, lay.bias
            if w in updates:
                updates[w] = updates[w] * _weight_side(s_rows, s_cols)
            if b is not None and b in updates:
                updates[b] = updates[b] * _out_side(lay, s_rows, s_cols)
        return StepResult(updates, result.ok, result.update_dot, result.grad_sq)


def _weight_side(s_rows: Tensor, s_cols: Tensor) -> Tensor:
    """``S`` of a weight ``[R, C]``: the outer product of its row and column factors."""
    return s_rows[:, None] * s_cols[None, :]


def _out_side(layer: CoveredLayer, s_rows: Tensor, s_cols: Tensor) -> Tensor:
    """The output side's factor (the bias's): rows, or columns for a transposed Linear."""
    return s_cols if layer.spec.transposed else s_rows


def scale_record(layer: CoveredLayer, rec: Record, s_rows: Tensor, s_cols: Tensor) -> None:
    """Replace ``rec``'s tensors by those of the rows ``J S`` (new tensors: an input shared
    with another layer's record is left as it is).

    Linear ``I [m, *, d_in]``, ``G [m, *, d_out]``: each scaled by its side's factor;
    Embedding ``I = idx``, ``G [m, *, D]``: ``G`` by the columns' factor and by the row
    factor of its index; materialized ``P [m, *weight.shape]`` by both, ``Gsum [m, d_out]``
    by the output side's."""
    if rec.P is not None:
        m = rec.P.shape[0]
        R, C = layer.weight.shape
        rec.P = (rec.P.reshape(m, R, C) * _weight_side(s_rows, s_cols)).reshape(rec.P.shape)
        if rec.Gsum is not None and rec.Gsum.numel():
            rec.Gsum = rec.Gsum * _out_side(layer, s_rows, s_cols)
        return
    assert rec.I is not None and rec.G is not None
    if layer.kind == "embedding":
        rec.G = rec.G * s_cols * s_rows[rec.I].unsqueeze(-1)
    elif layer.spec.transposed:
        rec.I, rec.G = rec.I * s_rows, rec.G * s_cols
    else:
        rec.I, rec.G = rec.I * s_cols, rec.G * s_rows
