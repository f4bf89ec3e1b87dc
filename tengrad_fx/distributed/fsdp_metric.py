"""TENGraD's base metric (``metric="factored"`` / ``"kronecker"``, :mod:`tengrad_fx.optim.tengrad.metric`)
on FSDP2-sharded weights: :class:`ShardedMetric`, the change of variables ``S = D^{-1/2}`` of
:mod:`~tengrad_fx.optim.tengrad.metric_scaling` with each rank holding rows ``R_r`` of
every gradient ``g [R, C]`` (FSDP's reduce-scatter of the global batch's mean gradient).

Every rank keeps the whole moments and ``S``'s whole factors (the same values on every
rank, as one process's: a weight's ``[R] + [C]``, or ``[R, R] + [C, C]``), so it scales its
own records by ``S`` before they move, as under DDP (``freeze`` is one process's; with
``Metric.root_every`` it keeps them and rescales them as one process does,
:meth:`ShardedMetric.refresh_roots`, and they move again), and:

* ``"factored"``: the row means of ``g²`` are each rank's own rows, the column means its
  shard's column sums; one all_reduce over the shard group per step sums both (``R + C``
  values per weight; zeros on the rows another rank holds);
* ``"kronecker"``: ``L = E[g gᵀ]`` couples rows of every shard, so each covered weight's
  gradient is all-gathered over the shard group (one layer at a time, then dropped) and the
  moments are one process's (:meth:`.KroneckerMetric.observe` on it);
* ``S g`` and ``u = S ũ`` on rows ``R_r``: ``s_rows[R_r] ⊙ g_r`` for a diagonal side,
  ``S_L[R_r, :] g`` (the whole ``g`` or ``ũ`` all-gathered) for a full one, the columns'
  factor applied locally (columns are not sharded); a bias's rows alike with the output
  side's factor.

``Σ u·g`` is unchanged (``ũ·(S g) = u·g``, summed over the shard group as without a metric).
"""
from __future__ import annotations

from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any, Iterator, Optional, cast

import torch
import torch.distributed as dist
from torch import Tensor

from ..curvature.layer import CoveredLayer
from ..optim.step.result import StepResult
from ..optim.tengrad.kronecker_metric import KroneckerMetric, full_sides
from ..optim.tengrad.metric import FactoredMetric
from ..optim.tengrad.metric_scaling import ScaledMetric, ema_finite_, metric_covers, norm_covers, scale_along
from .comm import collective
from .fsdp_rows import like, local, row_range

__all__ = ["ShardedMetric"]


def _whole(p: Tensor, shard: Tensor) -> Tensor:
    """The whole tensor of which ``shard`` is this rank's rows of ``p`` (all-gathered over the
    shard group)."""
    return like(p, shard).full_tensor()  # type: ignore[attr-defined]


def _whole_proxy(p: Tensor) -> Tensor:
    """A storage-less tensor of ``p``'s shape whose ``.grad`` is ``p``'s whole gradient."""
    g = _whole(p, local(p.grad))  # type: ignore[arg-type]
    proxy = g.new_empty(()).expand(g.shape)
    proxy.grad = g
    return proxy


def _side_rows(p: Tensor, x: Tensor, s: Tensor) -> Tensor:
    """This rank's rows of ``s x`` (``x``: the local rows ``[R_r, ...]`` of ``p``'s shape;
    ``s`` the dim-0 side's factor, diagonal ``[R]`` or full symmetric ``[R, R]``)."""
    a, b = row_range(p)
    if s.ndim == 1:
        return s[a:b].reshape(-1, *([1] * (x.ndim - 1))) * x
    whole = _whole(p, x)
    return (s[a:b] @ whole.reshape(whole.shape[0], -1)).reshape(b - a, *whole.shape[1:])


def _out_side(lay: CoveredLayer, s_rows: Tensor, s_cols: Tensor) -> Tensor:
    """The bias's factor: the output side's (rows, or columns of a transposed Linear)."""
    return s_cols if lay.spec.transposed else s_rows


class ShardedMetric:
    """``base`` (a :class:`~tengrad_fx.optim.tengrad.metric_scaling.ScaledMetric`) on the row
    shards (module docstring), with the same calls as ``base`` (TENGraD's step makes them).

    Args:
        base: the metric TENGraD built from its ``metric`` option.
        shards: the distribution (its ``shard_group``, set when it is bound).
    """

    def __init__(self, base: ScaledMetric, shards: Any):
        self.base, self.shards = base, shards

    @property
    def root_every(self) -> Optional[int]:
        """``base``'s: ``S`` recomputed every this many steps between curvature steps (:meth:`refresh_roots`)."""
        return self.base.root_every

    def observe(self, state: Any, layers: list[CoveredLayer]) -> None:
        """Fold this step's gradient into each covered weight's whole moments."""
        covered = [lay for lay in layers if metric_covers(lay) and lay.weight.grad is not None]
        if isinstance(self.base, FactoredMetric):
            self._observe_factored(state, covered)
            return
        norms = [lay for lay in layers if norm_covers(lay) and self.base.covers(lay) and lay.weight.grad is not None]
        for lay in covered + norms:  # the whole gradients, one layer at a time
            w, b = lay.weight, lay.bias
            proxy = _whole_proxy(w)
            bias = _whole_proxy(b) if b is not None and b.grad is not None else None
            view = SimpleNamespace(weight=proxy, bias=bias, bias_only=False, kind=lay.kind, spec=lay.spec)
            self.base.observe({proxy: state[w]}, [cast(CoveredLayer, view)])

    def _observe_factored(self, state: Any, covered: list[CoveredLayer]) -> None:
        """The row means of ``g²`` (this rank's rows, zeros elsewhere) and its column means (this
        shard's sums over ``R``), summed over the shard group in one all_reduce, into the EMAs."""
        parts = []
        for lay in covered:
            w = lay.weight
            g2 = local(w.grad).square()  # type: ignore[arg-type]
            a, b = row_range(w)
            rows = g2.new_zeros(w.shape[0])
            rows[a:b] = g2.mean(1)
            parts += [rows, g2.sum(0) / w.shape[0]]
        if not parts:
            return
        flat = torch.cat(parts)
        group = self.shards.shard_group
        collective("sum of the row shards' metric moments", lambda: dist.all_reduce(flat, group=group))
        moments = iter(flat.split([t.numel() for t in parts]))
        for lay in covered:
            w = lay.weight
            st = state[w]
            if "metric_rows" not in st:
                st["metric_rows"] = torch.zeros(w.shape[0], dtype=w.dtype, device=flat.device)
                st["metric_cols"] = torch.zeros(w.shape[1], dtype=w.dtype, device=flat.device)
            ema_finite_(st["metric_rows"], self.base.beta2, next(moments))
            ema_finite_(st["metric_cols"], self.base.beta2, next(moments))

    def template(self, p: Tensor, layers: list[CoveredLayer]) -> dict[str, Tensor]:
        """Zeros of the metric's state of the weight ``p`` (of a covered layer of ``layers``; else
        empty) in its shapes: the keys a fresh optimizer's ``state_dict`` lists for
        ``torch.distributed.checkpoint`` to load into (:meth:`.fsdp_optimizer.FSDPTENGraD.state_dict`)."""
        lay = next((lay for lay in layers if lay.weight is p and self.base.covers(lay)), None)
        if lay is None:
            return {}
        if norm_covers(lay):  # γ's and β's diagonal factors, flat
            shapes: tuple[tuple[int, ...], ...] = ((p.numel(),), (p.numel(),))
        else:
            R, C = p.shape
            full = full_sides(lay) if isinstance(self.base, KroneckerMetric) else (False, False)
            shapes = ((R, R) if full[0] else (R,), (C, C) if full[1] else (C,))
        zeros = [torch.zeros(shape, dtype=p.dtype, device=local(p).device) for shape in shapes]
        return {key: z.clone() for keys in (self.base.MOMENTS, self.base.SCALES) for key, z in zip(keys, zeros)}

    def freeze(self, state: Any, layers: list[CoveredLayer]) -> None:
        """One process's: ``S`` from the whole moments, this rank's own (whole) records scaled."""
        self.base.freeze(state, layers)

    def refresh_roots(self, state: Any, layers: list[CoveredLayer]) -> None:
        """One process's: ``S`` from the whole moments, this rank's own (whole) kept records
        rescaled (the strategy put them back in the store and moves them again)."""
        self.base.refresh_roots(state, layers)

    @contextmanager
    def scaled_grads(self, state: Any, layers: list[CoveredLayer]) -> Iterator[None]:
        """Within: each covered weight's (and bias's) ``.grad`` is its rows of ``S g``; restored after."""
        saved: list[tuple[Tensor, Tensor]] = []
        try:
            for lay in layers:
                s = self.base.scales(state, lay)
                if s is None:
                    continue
                for p, x in self._scaled(lay, s, {q: local(q.grad) for q in lay.params if q.grad is not None}):
                    saved.append((p, p.grad))  # type: ignore[arg-type]
                    p.grad = like(p, x)
            yield
        finally:
            for p, g in saved:
                p.grad = g

    def unscale(self, state: Any, layers: list[CoveredLayer], result: StepResult) -> StepResult:
        """``u = S ũ`` on this rank's rows of every covered weight and bias in ``result.updates``."""
        updates = dict(result.updates)
        for lay in layers:
            s = self.base.scales(state, lay)
            if s is not None:
                updates.update(self._scaled(lay, s, {p: updates[p] for p in lay.params if p in updates}))
        return StepResult(updates, result.ok, result.update_dot, result.grad_sq)

    def _scaled(self, lay: CoveredLayer, s: tuple[Tensor, Tensor],
                rows: dict[Tensor, Tensor]) -> list[tuple[Tensor, Tensor]]:
        """``(p, its rows of S x)`` for the layer's weight and bias in ``rows`` (``p -> x``, local rows)."""
        s_rows, s_cols = s
        out: list[tuple[Tensor, Tensor]] = []
        w, b = lay.weight, lay.bias
        if norm_covers(lay):  # γ by s_rows, β by s_cols, elementwise on this rank's entries
            return [(p, _side_rows(p, rows[p], side)) for p, side in ((w, s_rows), (b, s_cols))
                    if p is not None and p in rows]
        if w in rows:
            out.append((w, scale_along(_side_rows(w, rows[w], s_rows), s_cols)))
        if b is not None and b in rows:
            out.append((b, _side_rows(b, rows[b], _out_side(lay, s_rows, s_cols))))
        return out
