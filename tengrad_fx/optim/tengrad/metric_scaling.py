"""The change of variables shared by TENGraD's base metrics (:mod:`.metric`, :mod:`.kronecker_metric`).

The update of a layer is ``u = (F + αD)⁻¹ g`` with ``D = D_rows ⊗ D_cols`` over its weight
``W [R, C]`` in place of the identity. With the symmetric ``S = D^{-1/2} = S_rows ⊗ S_cols``,

    u = S (S F S + αI)⁻¹ S g,

and ``S F S`` is the Fisher of the rows ``J S``: the plain step's Woodbury solve, run on the
records scaled by ``S`` (:meth:`ScaledMetric.freeze`, :func:`scale_record`) and on ``S g``
(:meth:`ScaledMetric.scaled_grads`), gives ``S⁻¹ u`` (:meth:`ScaledMetric.unscale`).
So the inverse stays exact for the chosen ``D``; only the ``m`` directions the rows span
see the curvature, and every other direction gets ``D⁻¹ g / α`` instead of SGD's ``g / α``.

Each side's factor is a diagonal ``[n]`` or a full symmetric matrix ``[n, n]``; a weight's
``S g`` is ``S_rows g S_cols`` (:func:`scale_weight`), a vector along a side is multiplied by
it from the right (:func:`scale_along`). In record terms (``I`` the inputs, ``G`` the output
gradients of a Linear): ``I`` is scaled by the input side's ``S`` and ``G`` by the output
side's, so the Gram keeps its factor form ``(I S_in² Iᵀ) ⊙ (G S_out² Gᵀ)``; the bias
``[d_out]`` gets the output side's factor (its ``J`` block is ``Σ_t G_t``).

Covered (:func:`metric_covers`): Linear weights (``[d_out, d_in]``, a transposed Linear's
``[d_in, d_out]``, a table tied to a Linear, whose lookups are recorded as Linear calls) and
Embedding tables (``[vocab, D]``: ``I`` holds indices, ``G [m, *, D]``; the vocabulary side
diagonal), and, for a metric with :attr:`ScaledMetric.NORMS`, the affine weight ``γ`` and bias
``β`` of norm layers (:func:`norm_covers`), each with its own diagonal factor (the pair's
"rows" and "columns" are ``γ``'s and ``β``'s, flat ``[C]``): with ``J_γ = Σ_s G ⊙ x̂`` and
``J_β = Σ_s G``, the rows ``J S`` are those of ``G S_β`` and ``x̂ S_γ S_β⁻¹``
(:func:`scale_norm_record`). Other layers keep ``D = I``.

``S`` is fixed at each curvature step (the cached factors are those of ``S F S`` with that
``S``) and written in place, so a captured CUDA graph reads the same storage. With
``root_every = k`` it is also recomputed every ``k`` steps in between
(:meth:`ScaledMetric.refresh_roots`): the kept rows ``J S_old`` become ``J S_new`` by
``S_old⁻¹ S_new`` on each side (:func:`tengrad_fx.solve.root_change`; the unscaled rows are
not kept), after which the caller rebuilds their Grams and factors; no new capture. The moments
are updated on every step, on the device, skipping a non-finite gradient (a skipped step
leaves them as they were). All of it lives in the optimizer's state of each weight, so
``state_dict`` keeps it.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator, Optional

import torch
from torch import Tensor

from ... import solve
from ...capture.norm import CHANNEL_FIRST, NORM_KINDS
from ...capture.store import Record
from ...curvature.layer import CoveredLayer
from ..step.result import StepResult

__all__ = ["ScaledMetric", "ema_finite_", "metric_covers", "norm_covers", "scale_along", "scale_norm_record",
           "scale_params", "scale_record", "scale_weight", "vocabulary_rows"]


def metric_covers(layer: CoveredLayer) -> bool:
    """Whether ``layer``'s weight gets a base metric ``D`` (Linear or Embedding, 2-D weight)."""
    return not layer.bias_only and layer.kind in ("linear", "embedding") and layer.weight.ndim == 2


def norm_covers(layer: CoveredLayer) -> bool:
    """Whether ``layer`` is a norm layer with a trainable affine weight ``γ``."""
    return not layer.bias_only and layer.kind in NORM_KINDS


def vocabulary_rows(layer: CoveredLayer) -> bool:
    """Whether the weight's rows are a vocabulary: an Embedding table, or a Linear tied to one."""
    return layer.kind == "embedding" or bool(layer.spec.tied_names)


def ema_finite_(moment: Tensor, beta2: float, new: Tensor) -> None:
    """``moment ← β₂·moment + (1 − β₂)·new`` in place, on the device; left as it was where the
    result is not finite (a non-finite gradient, which skips its step, changes nothing)."""
    value = moment.mul(beta2).add(new, alpha=1.0 - beta2)
    moment.copy_(torch.where(value.isfinite().all(), value, moment))


def scale_along(x: Tensor, s: Tensor) -> Tensor:
    """``x [..., n]`` times a side's factor: ``x * s`` (diagonal ``s [n]``) or ``x @ s``
    (full symmetric ``s [n, n]``)."""
    return x * s if s.ndim == 1 else x @ s


def scale_weight(w: Tensor, s_rows: Tensor, s_cols: Tensor) -> Tensor:
    """``S_rows w S_cols`` of ``w [..., R, C]`` (each factor diagonal or full)."""
    if s_rows.ndim == 1 and s_cols.ndim == 1:
        return w * (s_rows[:, None] * s_cols[None, :])
    left = s_rows[:, None] * w if s_rows.ndim == 1 else s_rows @ w
    return scale_along(left, s_cols)


def _out_side(layer: CoveredLayer, s_rows: Tensor, s_cols: Tensor) -> Tensor:
    """The output side's factor (the bias's): rows, or columns for a transposed Linear."""
    return s_cols if layer.spec.transposed else s_rows


def scale_params(layer: CoveredLayer, w: Optional[Tensor], b: Optional[Tensor], s_rows: Tensor,
                 s_cols: Tensor) -> tuple[Optional[Tensor], Optional[Tensor]]:
    """``S`` applied to ``w`` (the weight's shape) and ``b`` (the bias's), either None: a norm
    layer's ``γ`` by ``s_rows``, ``β`` by ``s_cols`` (flat ``[C]``, elementwise); else
    ``S_rows w S_cols`` and the bias by the output side's factor."""
    if layer.kind in NORM_KINDS:
        return (None if w is None else w * s_rows.reshape(w.shape),
                None if b is None else b * s_cols.reshape(b.shape))
    return (None if w is None else scale_weight(w, s_rows, s_cols),
            None if b is None else scale_along(b, _out_side(layer, s_rows, s_cols)))


def scale_norm_record(layer: CoveredLayer, rec: Record, s_w: Tensor, s_b: Tensor) -> None:
    """:func:`scale_record` of a norm layer (``s_w``, ``s_b``: ``γ``'s and ``β``'s diagonal
    factors ``[C]``): materialized ``P [m, *γ.shape]`` by ``s_w``, ``Gsum [m, C]`` by ``s_b``;
    else ``G`` by ``s_b`` and ``x̂ = I`` by ``s_w / s_b`` (channel-first kinds ``[m, C, *sp]``,
    the others ``[m, *positions, *γ.shape]``)."""
    if rec.P is not None:
        rec.P = (rec.P.reshape(rec.P.shape[0], -1) * s_w).reshape(rec.P.shape)
        if rec.Gsum is not None and rec.Gsum.numel():
            rec.Gsum = (rec.Gsum.reshape(rec.Gsum.shape[0], -1) * s_b).reshape(rec.Gsum.shape)
        return
    assert rec.I is not None and rec.G is not None
    shape = (-1, *[1] * (rec.I.ndim - 2)) if layer.kind in CHANNEL_FIRST else tuple(layer.weight.shape)
    rec.I, rec.G = rec.I * (s_w / s_b).reshape(shape), rec.G * s_b.reshape(shape)


def scale_record(layer: CoveredLayer, rec: Record, s_rows: Tensor, s_cols: Tensor) -> None:
    """Replace ``rec``'s tensors by those of the rows ``J S`` (new tensors: an input shared
    with another layer's record is left as it is). Each factor acts on a row vector from the
    right (``x @ s``; ``S``'s own are symmetric, :func:`tengrad_fx.solve.root_change`'s not).

    Linear ``I [m, *, d_in]``, ``G [m, *, d_out]``: each scaled by its side's factor;
    Embedding ``I = idx``, ``G [m, *, D]``: ``G`` by the columns' factor and by the row
    (diagonal) factor of its index; materialized ``P [m, *weight.shape]`` by both,
    ``Gsum [m, d_out]`` by the output side's."""
    if layer.kind in NORM_KINDS:
        return scale_norm_record(layer, rec, s_rows, s_cols)
    if rec.P is not None:
        m = rec.P.shape[0]
        R, C = layer.weight.shape
        left = s_rows.mT if s_rows.ndim == 2 else s_rows  # S_rows w: (wᵀ S_rows)ᵀ
        rec.P = scale_weight(rec.P.reshape(m, R, C), left, s_cols).reshape(rec.P.shape)
        if rec.Gsum is not None and rec.Gsum.numel():
            rec.Gsum = scale_along(rec.Gsum, _out_side(layer, s_rows, s_cols))
        return
    assert rec.I is not None and rec.G is not None
    if layer.kind == "embedding":
        rec.G = scale_along(rec.G, s_cols) * s_rows[rec.I].unsqueeze(-1)
    elif layer.spec.transposed:
        rec.I, rec.G = scale_along(rec.I, s_rows), scale_along(rec.G, s_cols)
    else:
        rec.I, rec.G = scale_along(rec.I, s_cols), scale_along(rec.G, s_rows)


class ScaledMetric:
    """A base metric ``D = D_rows ⊗ D_cols`` of every covered layer and its change of
    variables (module docstring). A subclass keeps the moments (:meth:`observe`, under
    :attr:`MOMENTS`) and maps them to ``S``'s factors (:meth:`side_scales`).

    Args:
        beta2: the moments' EMA factor, in ``[0, 1)``.
        root_every: recompute ``S`` every this many steps between curvature steps
            (:meth:`refresh_roots`); None: fixed from one curvature step to the next.
    """

    MOMENTS: tuple[str, str] = ("", "")  # state keys of the rows' and the columns' moments
    SCALES: tuple[str, str] = ("", "")  # state keys of S's fixed factors
    NORMS = False  # norm layers' γ and β get diagonal factors (module docstring)

    def __init__(self, beta2: float = 0.99, root_every: Optional[int] = None):
        if not 0.0 <= beta2 < 1.0:
            raise ValueError(f"metric_beta2 must be in [0, 1), got {beta2}")
        self.beta2, self.root_every = beta2, root_every
        self._scaled: dict[int, Record] = {}  # id -> record, the records scaled at the last curvature step

    def observe(self, state: Any, layers: list[CoveredLayer]) -> None:
        """Fold this step's gradient into each covered weight's moments."""
        raise NotImplementedError

    def side_scales(self, moments: list[Tensor]) -> list[Tensor]:
        """``S``'s factor of each moment (of the layers' sides whose records are new)."""
        raise NotImplementedError

    def covers(self, layer: CoveredLayer) -> bool:
        """Whether ``layer`` gets a ``D`` (:func:`metric_covers`, or :func:`norm_covers` with :attr:`NORMS`)."""
        return metric_covers(layer) or (self.NORMS and norm_covers(layer))

    def scales(self, state: Any, layer: CoveredLayer) -> Optional[tuple[Tensor, Tensor]]:
        """``(s_rows, s_cols)``: ``S``'s factors fixed at the last curvature step (None:
        ``D = I`` for this layer)."""
        st = state.get(layer.weight, {}) if self.covers(layer) else {}
        if self.SCALES[0] not in st:
            return None
        return st[self.SCALES[0]], st[self.SCALES[1]]

    def freeze(self, state: Any, layers: list[CoveredLayer]) -> None:
        """On a curvature step: fix ``S`` from the moments and scale the new records of
        every covered layer by it (records scaled before keep theirs, and their ``S``)."""
        scaled: dict[int, Record] = {}
        todo: list[tuple[CoveredLayer, list[Record]]] = []
        for lay in layers:
            if not self.covers(lay) or not lay.captured or self.MOMENTS[0] not in state[lay.weight]:
                continue
            recs = lay.records()
            if all(self._scaled.get(id(r)) is r for r in recs):
                scaled.update({id(r): r for r in recs})
            else:
                todo.append((lay, recs))
        new = iter(self.side_scales([state[lay.weight][k] for lay, _ in todo for k in self.MOMENTS]))
        for lay, recs in todo:
            st = state[lay.weight]
            for key in self.SCALES:
                s = next(new)
                if key in st and st[key].shape == s.shape:
                    st[key].copy_(s)  # in place: a captured CUDA graph reads the same storage
                else:
                    st[key] = s
            for r in recs:
                scale_record(lay, r, st[self.SCALES[0]], st[self.SCALES[1]])
                scaled[id(r)] = r
        self._scaled = scaled

    def refresh_roots(self, state: Any, layers: list[CoveredLayer]) -> None:
        """Between curvature steps: ``S`` recomputed from the moments (:meth:`side_scales`) for
        every covered layer with kept records, which become the rows ``J S_new`` (scaled by
        ``S_old⁻¹ S_new``); ``S`` written in place. The caller rebuilds their Grams."""
        kept = [lay for lay in layers if self.scales(state, lay) is not None and lay.captured]
        new = iter(self.side_scales([state[lay.weight][k] for lay in kept for k in self.MOMENTS]))
        for lay in kept:
            olds = [state[lay.weight][key] for key in self.SCALES]
            news = [next(new) for _ in olds]
            change = [solve.root_change(o, n) for o, n in zip(olds, news)]
            for r in lay.records():
                scale_record(lay, r, *change)
            for o, n in zip(olds, news):
                o.copy_(n)  # in place: a captured CUDA graph reads the same storage

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
                gb = b.grad if b is not None else None
                sw, sb = scale_params(lay, w.grad, gb, s_rows, s_cols)
                for param, g, scaled in ((w, w.grad, sw), (b, gb, sb)):
                    if param is not None and g is not None and scaled is not None:
                        saved.append((param, g))
                        param.grad = scaled
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
            uw, ub = scale_params(lay, updates.get(w), updates.get(b) if b is not None else None, s_rows, s_cols)
            for p, u in ((w, uw), (b, ub)):
                if p is not None and u is not None:
                    updates[p] = u
        return StepResult(updates, result.ok, result.update_dot, result.grad_sq)
