"""The four forms of a :class:`~tengrad_fx.optim.tengrad.tengrad_groups.LayerGroup`, one
class each, with their Gram ``K = J Jᵀ``, ``J g``, ``Jᵀ c``, the fused ``u = β·g + γ·Jᵀc``
where one exists, and the push-through probe's coordinates (:mod:`.group_probe`):

* :class:`MaterializedGroup` (``"P"``) — stacked (or packed) per-sample gradients;
* :class:`FactoredLinearGroup` (``"IG"``) — single-position Linear layers by ``I``, ``G``;
* :class:`ConvStackGroup` (``"conv"``) — convolutions kept as ``I``, ``G``;
* :class:`SingleLayerGroup` (``"layer"``) — one layer through its ``CoveredLayer``.

Shapes: :mod:`.tengrad_groups`' module docstring.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor

from ...curvature import conv_stack, conv_stack_bmm
from .group_probe import ProbeTerms, conv_probe_rows, probe_generator
from .tengrad_groups import LayerGroup, scaled_bmm

__all__ = ["MaterializedGroup", "FactoredLinearGroup", "ConvStackGroup", "SingleLayerGroup", "FORMS"]


class MaterializedGroup(LayerGroup):
    """``"P"``: ``J = k·[Pw, Pb]`` (``Pw [L, m, n_w]``, ``Pb [L, m, n_b]`` or None); packed
    (``cols`` set): ``Pw [L, m, W]``, each layer's ``[P_w, P_b]`` then zeros, ``Pb`` None."""

    form = "P"

    @property
    def has_bias(self) -> bool:
        return self.Pb is not None

    def stacks(self) -> tuple[Optional[Tensor], Optional[Tensor]]:
        return self.Pw, self.Pb

    def _point_record(self, r: Any, x: Tensor, y: Optional[Tensor]) -> None:
        if r.P is not None:
            r.P = x
            if y is not None:
                r.Gsum = y

    def gram(self) -> Tensor:
        assert self.Pw is not None
        kk = self.k * self.k
        K = scaled_bmm(self.Pw, self.Pw.transpose(1, 2), kk)
        if self.Pb is not None:
            K = torch.baddbmm(K, self.Pb, self.Pb.transpose(1, 2), alpha=kk)
        return K

    def jvp(self, gw: Tensor, gb: Optional[Tensor]) -> Tensor:
        assert self.Pw is not None
        # row-vector form gᵀ Pᵀ ([L,1,n]·[L,n,m]): a batched GEMV that reads P once
        # row-major (the column form P·g is 3–5× slower batched on CPU BLAS)
        out = torch.baddbmm(self.Pw.new_empty(()), gw.unsqueeze(1), self.Pw.transpose(1, 2), beta=0.0, alpha=self.k)
        if self.Pb is not None and gb is not None:
            out = torch.baddbmm(out, gb.unsqueeze(1), self.Pb.transpose(1, 2), alpha=self.k)
        return out.squeeze(1)

    def vjp(self, c: Tensor) -> tuple[Tensor, Optional[Tensor]]:
        assert self.Pw is not None
        c = c.to(self.Pw.dtype) * self.k
        w = torch.bmm(c.unsqueeze(1), self.Pw).squeeze(1)  # cᵀ P, [L, 1, n_w]
        b = torch.bmm(c.unsqueeze(1), self.Pb).squeeze(1) if self.Pb is not None else None
        return w, b

    def _woodbury(self, c: Tensor, gw: Tensor, gb: Optional[Tensor], beta: float, gamma: float,
                  ) -> tuple[Tensor, Optional[Tensor]]:
        assert self.Pw is not None
        c3 = c.to(self.Pw.dtype).unsqueeze(1)  # [L, 1, m]: cᵀ P row form, as in jvp
        uw = torch.baddbmm(gw.unsqueeze(1), c3, self.Pw, beta=beta, alpha=gamma * self.k)
        ub = None
        if self.Pb is not None and gb is not None:
            ub = torch.baddbmm(gb.unsqueeze(1), c3, self.Pb, beta=beta, alpha=gamma * self.k)
        return uw.squeeze(1), (ub.squeeze(1) if ub is not None else None)

    def _probe_terms(self, gw: Tensor, s: float, n_probe: int) -> ProbeTerms:
        """Packed: every column (small layers only); else ``n_probe`` random weight
        coordinates (an ``index_select``: a fraction of advanced indexing's host time) and
        the whole bias."""
        assert self.Pw is not None
        if self.cols is not None:
            return self.Pw.sum(1), gw, None, self.k * s
        gen = probe_generator(gw.device)
        idx = torch.randint(0, gw.shape[1], (min(n_probe, gw.shape[1]),), device=gw.device, generator=gen)
        got_b = self.Pb.sum(1) if self.Pb is not None else None
        return self.Pw.index_select(2, idx).sum(1), gw.index_select(1, idx), got_b, self.k * s


class FactoredLinearGroup(LayerGroup):
    """``"IG"``: inputs ``A [L, m, f]``, output gradients ``B [L, m, o]``,
    ``J_i = k·vec(B_i A_iᵀ, B_i)``."""

    form = "IG"

    def gram(self) -> Tensor:
        """``k²·(AAᵀ + 1)⊙BBᵀ`` (one ``addcmul``; ``AAᵀ⊙BBᵀ`` without a bias)."""
        assert self.A is not None and self.B is not None
        AA = torch.bmm(self.A, self.A.transpose(1, 2))
        BB = scaled_bmm(self.B, self.B.transpose(1, 2), self.k * self.k)
        return torch.addcmul(BB, AA, BB) if self.has_bias else AA * BB

    def jvp(self, gw: Tensor, gb: Optional[Tensor]) -> Tensor:
        """``k·Σ (A Gwᵀ)⊙B`` or ``k·Σ (B Gw)⊙A``: the order with the smaller ``[m, min(o, f)]``
        intermediate (equal flops ``m·o·f``)."""
        A, B = self.A, self.B
        assert A is not None and B is not None
        Gw = gw.view(gw.shape[0], B.shape[2], A.shape[2])  # [L, o, f]
        if B.shape[2] <= A.shape[2]:
            out = (torch.bmm(A, Gw.transpose(1, 2)) * B).sum(2)
        else:
            out = (torch.bmm(B, Gw) * A).sum(2)
        if gb is not None:
            out = out + torch.bmm(B, gb.unsqueeze(2)).squeeze(2)
        return out * self.k

    def vjp(self, c: Tensor) -> tuple[Tensor, Optional[Tensor]]:
        """``k·(B⊙c)ᵀ A`` and the bias part ``k·Σ B⊙c``."""
        assert self.A is not None and self.B is not None
        Bc = self.B * (c.to(self.B.dtype) * self.k).unsqueeze(2)
        w = torch.bmm(Bc.transpose(1, 2), self.A).flatten(1)
        return w, (Bc.sum(1) if self.has_bias else None)

    def _woodbury(self, c: Tensor, gw: Tensor, gb: Optional[Tensor], beta: float, gamma: float,
                  ) -> tuple[Tensor, Optional[Tensor]]:
        assert self.A is not None and self.B is not None
        Bc = self.B * c.to(self.B.dtype).unsqueeze(2)  # [L, m, o]
        Gw = gw.view(gw.shape[0], self.B.shape[2], self.A.shape[2])  # [L, o, f]
        uw = torch.baddbmm(Gw, Bc.transpose(1, 2), self.A, beta=beta, alpha=gamma * self.k).flatten(1)
        ub = None
        if gb is not None and self.has_bias:
            ub = torch.add(gb * beta if beta != 1.0 else gb, Bc.sum(1), alpha=gamma * self.k)
        return uw, ub

    def _probe_terms(self, gw: Tensor, s: float, n_probe: int) -> ProbeTerms:
        """``n_probe`` coordinates ``(t, j)``, each a row ``t`` of ``B`` and a column ``j`` of
        ``A``, and the whole bias."""
        assert self.A is not None and self.B is not None
        gen = probe_generator(gw.device)
        o, f, n = self.B.shape[2], self.A.shape[2], min(n_probe, gw.shape[1])
        rows = torch.randint(0, o, (n,), device=gw.device, generator=gen)
        cols = torch.randint(0, f, (n,), device=gw.device, generator=gen)
        got = (self.B.index_select(2, rows) * self.A.index_select(2, cols)).sum(1)
        got_b = self.B.sum(1) if self.has_bias else None
        return got, gw.view(-1, o, f)[:, rows, cols], got_b, self.k * s


class ConvStackGroup(LayerGroup):
    """``"conv"``: ``A = I [m, L, c_in, *sp]``, ``B = G [m, L, c_out, *sp_out]`` (the layer
    axis after the sample axis); one convolution / ``bmm`` per group
    (:mod:`tengrad_fx.curvature.conv_stack`). Stacks with few output positions per sample
    take ``J g``, ``Jᵀ c`` and the probe by ``bmm`` over their unfolded inputs
    (:mod:`tengrad_fx.curvature.conv_stack_bmm`), the operands made once per set of stacks
    (:meth:`bmm_operands`)."""

    form = "conv"
    layer_axis = 1
    _bmm: Optional[tuple[Tensor, Tensor, int, int, Optional[conv_stack_bmm.Operands]]] = None

    def bmm_operands(self) -> Optional[conv_stack_bmm.Operands]:
        """The ``bmm`` form's operands of the stacks ``A``, ``B``, or None where that form does
        not apply (:func:`~tengrad_fx.curvature.conv_stack_bmm.applies`). Kept while the
        stacks are the same tensors, unwritten (their version counters); for a ``static``
        group (a captured CUDA graph reads them) stacks written in place (:meth:`refill`)
        have the kept operands rewritten in place, otherwise new ones are made."""
        A, B = self.A, self.B
        assert A is not None and B is not None
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
        assert self.A is not None and self.B is not None
        K = conv_stack.gram(self.layers[0].spec, self.A, self.B, self.strategy, self.has_bias)
        return K * (self.k * self.k)

    def jvp(self, gw: Tensor, gb: Optional[Tensor]) -> Tensor:
        assert self.A is not None and self.B is not None
        ops = self.bmm_operands()
        if ops is not None:
            return conv_stack_bmm.jvp(ops, gw, gb) * self.k
        return conv_stack.jvp(self.layers[0].spec, self.A, self.B, gw, gb) * self.k

    def vjp(self, c: Tensor) -> tuple[Tensor, Optional[Tensor]]:
        assert self.A is not None and self.B is not None
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
        assert self.A is not None and self.B is not None
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


class SingleLayerGroup(LayerGroup):
    """``"layer"``: one layer through :class:`~tengrad_fx.curvature.layer.CoveredLayer`
    (transposed convolutions, several calls of one module, sequences, norms by factor)."""

    form = "layer"

    def point_records(self) -> None:
        """Its records stay the layer's own."""

    def gram(self) -> Tensor:
        return self.layers[0].gram(self.strategy).unsqueeze(0)  # type: ignore[arg-type]

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
"""The group class of each form."""
