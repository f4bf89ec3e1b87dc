"""The forms of a :class:`~tengrad_fx.optim.tengrad.layer_groups.LayerGroup`, one class
each with that form's stacks only. Each takes its Gram ``K = J Jᵀ``, ``J g``, ``Jᵀ c`` and
fused ``u = β·g + γ·Jᵀc`` (where one exists) from the form's kernels in
:mod:`tengrad_fx.curvature` (the fused and distributed paths call the same functions), and
picks the push-through probe's coordinates (:mod:`.group_probe`):

* :class:`MaterializedGroup` (``"P"``) — stacked per-sample gradients
  (:mod:`tengrad_fx.curvature.materialized`);
* :class:`PackedGroup` (``"P"``, ``cols`` set) — small layers of different widths side by
  side in one zero-padded stack, the same kernels;
* :class:`FactoredLinearGroup` (``"IG"``) — single-position Linear layers by ``I``, ``G``
  (:mod:`tengrad_fx.curvature.factored`);
* :class:`ConvStackGroup` (``"conv"``) — convolutions kept as ``I``, ``G``
  (:mod:`tengrad_fx.curvature.conv_stack`, :mod:`tengrad_fx.curvature.conv_stack_bmm`);
* :class:`SingleLayerGroup` (``"layer"``) — one layer through its ``CoveredLayer``.

Shapes: :mod:`.layer_groups`' module docstring.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import Tensor

from ...curvature import conv_stack, conv_stack_bmm, factored, materialized
from ...curvature.layer import Strategy
from .group_probe import ProbeTerms, conv_probe_rows, probe_generator
from .layer_groups import LayerGroup, column_views, copy_new, pack

__all__ = ["MaterializedGroup", "PackedGroup", "FactoredLinearGroup", "ConvStackGroup", "SingleLayerGroup", "FORMS"]


@dataclass(eq=False, kw_only=True)
class MaterializedGroup(LayerGroup):
    """``"P"``: ``J = k·[Pw, Pb]`` (``Pw [L, m, n_w]``, ``Pb [L, m, n_b]`` or None)."""

    form = "P"
    Pw: Tensor
    Pb: Optional[Tensor] = None

    @property
    def has_bias(self) -> bool:
        return self.Pb is not None

    def stacks(self) -> tuple[Optional[Tensor], Optional[Tensor]]:
        return self.Pw, self.Pb

    def release(self) -> None:
        del self.Pw, self.Pb
        self._slices = None  # the records' views of the stacks would keep them alive

    def _point_record(self, r: Any, x: Tensor, y: Optional[Tensor]) -> None:
        if r.P is not None:
            r.P = x
            if y is not None:
                r.Gsum = y

    def gram(self) -> Tensor:
        return materialized.gram(self.Pw, self.Pb, self.k * self.k)

    def jvp(self, gw: Tensor, gb: Optional[Tensor]) -> Tensor:
        return materialized.jvp(self.Pw, self.Pb, gw, gb, self.k)

    def vjp(self, c: Tensor) -> tuple[Tensor, Optional[Tensor]]:
        return materialized.vjp(self.Pw, self.Pb, c, self.k)

    def _woodbury(self, c: Tensor, gw: Tensor, gb: Optional[Tensor], beta: float, gamma: float,
                  ) -> tuple[Tensor, Optional[Tensor]]:
        return materialized.woodbury(self.Pw, self.Pb, c, gw, gb, beta, gamma, self.k)

    def _probe_terms(self, gw: Tensor, s: float, n_probe: int) -> ProbeTerms:
        """``n_probe`` random weight coordinates (an ``index_select``: a fraction of advanced
        indexing's host time) and the whole bias."""
        gen = probe_generator(gw.device)
        idx = torch.randint(0, gw.shape[1], (min(n_probe, gw.shape[1]),), device=gw.device, generator=gen)
        got_b = self.Pb.sum(1) if self.Pb is not None else None
        return self.Pw.index_select(2, idx).sum(1), gw.index_select(1, idx), got_b, self.k * s


@dataclass(eq=False, kw_only=True)
class PackedGroup(MaterializedGroup):
    """``"P"``, packed: ``Pw [L, m, W]``, each layer's ``[P_w, P_b]`` from column 0 then
    zeros (``widths``: its ``(n_w, n_b)``), ``Pb`` None; gradients and updates in the same
    layout ``[L, W]``. ``fill``: the views of ``Pw`` a new capture is copied into."""

    widths: list[tuple[int, int]]
    fill: list[Tensor] = field(repr=False)
    _gpack: Optional[tuple[Tensor, list[Tensor]]] = field(default=None, init=False, repr=False)

    @property
    def cols(self) -> Optional[list[tuple[int, int]]]:
        return self.widths

    def release(self) -> None:
        super().release()
        self.fill, self._gpack = [], None

    def refill(self, parts: list[tuple[Tensor, Optional[Tensor]]]) -> None:
        """The zero columns are never written, so they stay zero."""
        copy_new(self.fill, [t for pair in parts for t in pair if t is not None])

    def _layer_slice(self, X: Tensor, i: int, Y: Optional[Tensor] = None,
                     records: bool = True) -> tuple[Tensor, Optional[Tensor]]:
        """The columns ``[:n_w]`` and ``[n_w : n_w + n_b]`` of ``X[i]`` (None without a bias)."""
        n_w, n_b = self.widths[i]
        return X[i, ..., :n_w], (X[i, ..., n_w: n_w + n_b] if n_b else None)

    def grads(self) -> tuple[Tensor, Optional[Tensor]]:
        """``(g [L, W], None)``: each layer's ``[g_w, g_b]`` then zeros."""
        pairs = self.param_pairs()
        gs = [p.grad for pair in pairs for p in pair if p is not None]
        if all(g is not None for g in gs):
            return self._packed_grads(pairs, [g.reshape(-1) for g in gs if g is not None]), None
        flat = [[p.grad.reshape(-1) if p is not None and p.grad is not None else None
                 for p in pair] for pair in pairs]
        for row, lay in zip(flat, self.layers):  # a missing weight gradient keeps its columns
            if row[0] is None and row[1] is not None:
                row[0] = torch.zeros_like(lay.weight).reshape(-1)
        if all(t is None for row in flat for t in row):
            return self.Pw.new_zeros(len(self.layers), self.Pw.shape[-1]), None
        return pack(flat, self.Pw.shape[-1], self.layers[0].weight), None

    def _packed_grads(self, pairs: list[tuple[Tensor, Optional[Tensor]]], flat: list[Tensor]) -> Tensor:
        """``g [L, W]`` when every parameter has a gradient (``flat``: them, flat, in order):
        one ``_foreach_copy_`` into a buffer kept by the group (its padding columns are zero
        once and never written)."""
        if self._gpack is None:
            buf = self.Pw.new_zeros(len(pairs), self.Pw.shape[-1], dtype=pairs[0][0].dtype)
            widths = [[p.numel() if p is not None else None for p in pair] for pair in pairs]
            self._gpack = (buf, column_views(buf, widths))
        buf, views = self._gpack
        torch._foreach_copy_(views, flat)
        return buf

    def _probe_terms(self, gw: Tensor, s: float, n_probe: int) -> ProbeTerms:
        """Every column (small layers only)."""
        return self.Pw.sum(1), gw, None, self.k * s


@dataclass(eq=False, kw_only=True)
class FactoredLinearGroup(LayerGroup):
    """``"IG"``: inputs ``A [L, m, f]``, output gradients ``B [L, m, o]``,
    ``J_i = k·vec(B_i A_iᵀ, B_i)``."""

    form = "IG"
    A: Tensor
    B: Tensor

    def stacks(self) -> tuple[Optional[Tensor], Optional[Tensor]]:
        return self.A, self.B

    def release(self) -> None:
        del self.A, self.B
        self._slices = None

    def gram(self) -> Tensor:
        return factored.gram(self.A, self.B, self.k * self.k, self.has_bias)

    def jvp(self, gw: Tensor, gb: Optional[Tensor]) -> Tensor:
        return factored.jvp(self.A, self.B, gw, gb, self.k)

    def vjp(self, c: Tensor) -> tuple[Tensor, Optional[Tensor]]:
        return factored.vjp(self.A, self.B, c, self.k, self.has_bias)

    def _woodbury(self, c: Tensor, gw: Tensor, gb: Optional[Tensor], beta: float, gamma: float,
                  ) -> tuple[Tensor, Optional[Tensor]]:
        return factored.woodbury(self.A, self.B, c, gw, gb if self.has_bias else None, beta, gamma, self.k)

    def _probe_terms(self, gw: Tensor, s: float, n_probe: int) -> ProbeTerms:
        """``n_probe`` coordinates ``(t, j)``, each a row ``t`` of ``B`` and a column ``j`` of
        ``A``, and the whole bias."""
        gen = probe_generator(gw.device)
        o, f, n = self.B.shape[2], self.A.shape[2], min(n_probe, gw.shape[1])
        rows = torch.randint(0, o, (n,), device=gw.device, generator=gen)
        cols = torch.randint(0, f, (n,), device=gw.device, generator=gen)
        got = (self.B.index_select(2, rows) * self.A.index_select(2, cols)).sum(1)
        got_b = self.B.sum(1) if self.has_bias else None
        return got, gw.view(-1, o, f)[:, rows, cols], got_b, self.k * s


@dataclass(eq=False, kw_only=True)
class ConvStackGroup(LayerGroup):
    """``"conv"``: ``A = I [m, L, c_in, *sp]``, ``B = G [m, L, c_out, *sp_out]`` (the layer
    axis after the sample axis), the Gram by ``strategy`` (``"factor"`` or
    ``"materialize"``); one convolution / ``bmm`` per group
    (:mod:`tengrad_fx.curvature.conv_stack`). Stacks with few output positions per sample
    take ``J g``, ``Jᵀ c`` and the probe by ``bmm`` over their unfolded inputs
    (:mod:`tengrad_fx.curvature.conv_stack_bmm`), the operands made once per set of stacks
    (:meth:`bmm_operands`)."""

    form = "conv"
    layer_axis = 1
    A: Tensor
    B: Tensor
    strategy: str = "auto"
    _bmm: Optional[tuple[Tensor, Tensor, int, int, Optional[conv_stack_bmm.Operands]]] = \
        field(default=None, init=False, repr=False)

    def stacks(self) -> tuple[Optional[Tensor], Optional[Tensor]]:
        return self.A, self.B

    def release(self) -> None:
        del self.A, self.B
        self._bmm, self._slices = None, None

    def _layer_slice(self, X: Tensor, i: int, Y: Optional[Tensor] = None,
                     records: bool = True) -> tuple[Tensor, Optional[Tensor]]:
        """The records' stacks on the layer axis 1; gradient and update pairs on axis 0."""
        if records:
            return X[:, i], (Y[:, i] if Y is not None else None)
        return super()._layer_slice(X, i, Y, records)

    def bmm_operands(self) -> Optional[conv_stack_bmm.Operands]:
        """The ``bmm`` form's operands of the stacks ``A``, ``B``, or None where that form does
        not apply (:func:`~tengrad_fx.curvature.conv_stack_bmm.applies`). Kept while the
        stacks are the same tensors, unwritten (their version counters); for a ``static``
        group (a captured CUDA graph reads them) stacks written in place (:meth:`refill`)
        have the kept operands rewritten in place, otherwise new ones are made."""
        A, B = self.A, self.B
        kept = self._bmm
        if kept is not None and kept[0] is A and kept[1] is B and kept[2] == A._version and kept[3] == B._version:
            return kept[4]
        spec = self.layers[0].spec
        ops = conv_stack_bmm.operands(spec, A, B) if conv_stack_bmm.applies(spec, A, B) else None
        old = kept[4] if kept is not None else None
        if ops is not None and old is not None and self.static \
                and all(o.shape == n.shape and o.dtype == n.dtype for o, n in zip(old, ops)):
            torch._foreach_copy_(list(old), list(ops))
            ops = old
        self._bmm = (A, B, A._version, B._version, ops)
        return ops

    def refill(self, parts: list[tuple[Tensor, Optional[Tensor]]]) -> None:
        """:meth:`LayerGroup.refill`, then the kept ``bmm`` operands rewritten in place
        (``static``) or dropped (made anew when next used)."""
        super().refill(parts)
        if self._bmm is not None and self.static:
            self.bmm_operands()
        else:
            self._bmm = None

    def gram(self) -> Tensor:
        K = conv_stack.gram(self.layers[0].spec, self.A, self.B, self.strategy, self.has_bias)
        return K * (self.k * self.k)

    def jvp(self, gw: Tensor, gb: Optional[Tensor]) -> Tensor:
        ops = self.bmm_operands()
        if ops is not None:
            return conv_stack_bmm.jvp(ops, gw, gb) * self.k
        return conv_stack.jvp(self.layers[0].spec, self.A, self.B, gw, gb) * self.k

    def vjp(self, c: Tensor) -> tuple[Tensor, Optional[Tensor]]:
        ops = self.bmm_operands()
        if ops is not None:
            w, b = conv_stack_bmm.vjp(ops, c * self.k)
        else:
            w, b = conv_stack.vjp(self.layers[0].spec, self.A, self.B, c * self.k)
        return w, (b if self.has_bias else None)

    def _woodbury(self, c: Tensor, gw: Tensor, gb: Optional[Tensor], beta: float, gamma: float,
                  ) -> tuple[Tensor, Optional[Tensor]]:
        """The ``bmm`` form's fused ``u`` (:func:`~tengrad_fx.curvature.conv_stack_bmm.woodbury`)
        where the gradients share the operands' dtype; else by :meth:`vjp`."""
        ops = self.bmm_operands()
        if ops is None or gw.dtype != ops.U.dtype or (gb is not None and gb.dtype != ops.U.dtype):
            return super()._woodbury(c, gw, gb, beta, gamma)
        return conv_stack_bmm.woodbury(ops, c, gw, gb if self.has_bias else None, beta, gamma * self.k)

    def _probe_terms(self, gw: Tensor, s: float, n_probe: int) -> ProbeTerms:
        """Random output channels of every group (:func:`.group_probe.conv_probe_rows`), by
        one weight-gradient convolution over those channels only
        (:func:`~tengrad_fx.curvature.conv_stack.channel_sums`) or the ``bmm`` form's
        (:func:`~tengrad_fx.curvature.conv_stack_bmm.channel_sums`); the full ``Jᵀ1`` where
        too few channels are there to sample."""
        spec = self.layers[0].spec
        n_r = conv_probe_rows(spec, n_probe)
        if n_r is None:
            return self._full_probe_terms(gw, s)
        c_out = spec.weight.shape[0]
        rows = torch.randint(0, c_out // spec.groups, (n_r,), device=gw.device, generator=probe_generator(gw.device))
        ops = self.bmm_operands()
        if ops is not None:  # ungrouped: the channels are the rows
            sums, channels = conv_stack_bmm.channel_sums(ops, rows), rows
        else:
            sums, channels = conv_stack.channel_sums(spec, self.A, self.B, rows)
        ref = gw.view(gw.shape[0], c_out, -1).index_select(1, channels).flatten(1)
        got_b = self.B.flatten(3).sum((0, 3)) if self.has_bias else None  # [L, c_out]
        return sums.flatten(1), ref, got_b, self.k * s


@dataclass(eq=False, kw_only=True)
class SingleLayerGroup(LayerGroup):
    """``"layer"``: one layer through :class:`~tengrad_fx.curvature.layer.CoveredLayer`
    (transposed convolutions, several calls of one module, sequences, norms by factor),
    its Gram by ``strategy``."""

    form = "layer"
    strategy: Strategy = "auto"

    def point_records(self) -> None:
        """Its records stay the layer's own."""

    def gram(self) -> Tensor:
        return self.layers[0].gram(self.strategy).unsqueeze(0)

    def jvp(self, gw: Tensor, gb: Optional[Tensor]) -> Tensor:
        lay = self.layers[0]
        vb = gb[0].view_as(lay.bias) if gb is not None and lay.bias is not None else None
        return lay.jvp(gw[0].view_as(lay.weight), vb).unsqueeze(0)

    def vjp(self, c: Tensor) -> tuple[Tensor, Optional[Tensor]]:
        w, b = self.layers[0].vjp(c[0])
        return w.reshape(1, -1), (b.reshape(1, -1) if b is not None else None)

    def _probe_terms(self, gw: Tensor, s: float, n_probe: int) -> ProbeTerms:
        return self._full_probe_terms(gw, s)


FORMS: dict[str, type[LayerGroup]] = {cls.form: cls for cls in
                                      (MaterializedGroup, FactoredLinearGroup, ConvStackGroup, SingleLayerGroup)}
"""The group class of each form (a packed ``"P"`` group: :class:`PackedGroup`)."""
