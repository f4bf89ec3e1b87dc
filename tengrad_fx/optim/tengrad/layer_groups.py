"""TENGraD's curvature as groups of equal-shape layers: one batched op per group.

Per covered layer, ``J`` (``[m, n]``, rows = per-sample gradients) enters the update only
through ``K = J Jᵀ``, ``J g`` and ``Jᵀ c``. Layers of equal shape and form are stacked
into a :class:`LayerGroup` (``L`` layers), so each of these is one ``bmm`` per group and
the number of ops a step dispatches does not grow with depth. Forms (one subclass each,
:mod:`.group_forms`, with that form's stacks only; each form's Gram, ``J g`` and ``Jᵀ c``
is one function of :mod:`tengrad_fx.curvature`, which the fused and distributed paths call
too):

* ``"P"`` — materialized per-sample gradients (made by the backward in place of the
  weight gradient): ``Pw [L, m, n_w]``, ``Pb [L, m, n_b]`` (or None), ``J = k·[Pw, Pb]``.
  ``J g`` and ``Jᵀ c`` are two GEMVs per layer over ``P`` (one ``bmm`` each per group;
  :mod:`tengrad_fx.curvature.materialized`). *Packed* (``PackedGroup``, ``cols`` set):
  layers of different widths in one group, each layer's ``[P_w, P_b]`` side by side in
  ``Pw [L, m, W]`` (``W`` = the widest layer's ``n_w + n_b``, zeros after ``n_w + n_b``;
  ``Pb`` None), its gradient likewise in ``g [L, W]``. Zero
  columns add nothing to ``K = P Pᵀ`` or ``J g``, and the padded part of ``Jᵀ c`` / ``u``
  is zero and sliced away by :meth:`LayerGroup.split`, so packing is exact
  (which layers are packed: :mod:`tengrad_fx.optim.tengrad.group_build`).
* ``"IG"`` — Linear layers with one position per sample, by factorization: inputs
  ``A [L, m, f]``, captured output gradients ``B [L, m, o]``, ``J_i = k·vec(B_i A_iᵀ, B_i)``.
  ``J g = k·Σ (A Gwᵀ)⊙B`` or ``k·Σ (B Gw)⊙A`` — the order with the smaller ``[m, min(o, f)]``
  intermediate (equal flops ``m·o·f``); ``Jᵀ c = k·(B⊙c)ᵀ A``
  (:mod:`tengrad_fx.curvature.factored`).
* ``"conv"`` — convolutions kept as their captured ``I, G`` (factored by the cost model,
  or materialized beyond ``jacobian_budget_mb``), stacked along a layer axis after the
  sample axis: ``A = I [m, L, c_in, *sp]``, ``B = G [m, L, c_out, *sp_out]``; the Gram, ``J g``
  and ``Jᵀ c`` are one convolution / ``bmm`` per group
  (:mod:`tengrad_fx.curvature.conv_stack`; few output positions by ``bmm``,
  :mod:`tengrad_fx.curvature.conv_stack_bmm`).
* ``"layer"`` — one layer through :class:`~tengrad_fx.curvature.layer.CoveredLayer`
  (transposed convolutions, several calls of one module, sequences, norms by factor).

``k`` is the per-sample scale of the captured ``G`` (``m`` for a mean loss). Gradients of
a group are stacked the same way: ``gw [L, n_w]``, ``gb [L, n_b]``. The groups of a step
are built by :func:`tengrad_fx.optim.tengrad.group_build.build_groups`.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, ClassVar, Iterator, Optional, Protocol, Union

import torch
from torch import Tensor

from ... import solve
from ...curvature.batched import scaled_bmm
from ...curvature.layer import CoveredLayer
from ..step.sharding import WHOLE, Sharding
from .group_probe import ProbeTerms

__all__ = ["LayerGroup", "Products", "RowSplit", "copy_new", "group_products", "pack", "pack_views", "precondition",
           "scaled_bmm", "stack", "tf32_matmuls"]

@contextlib.contextmanager
def tf32_matmuls(enabled: bool) -> Iterator[None]:
    """Inside: float32 CUDA matmuls may use TF32 tensor cores (10-bit mantissa inputs,
    fp32 accumulation); the previous setting is restored on exit. No effect on CPU or
    other dtypes. Used for the Grams of a curvature step (``TENGraD(gram_tf32=True)``)."""
    if not enabled:
        yield
        return
    mm = torch.backends.cuda.matmul
    new_api = hasattr(mm, "fp32_precision")
    old = mm.fp32_precision if new_api else mm.allow_tf32
    if new_api:
        mm.fp32_precision = "tf32"
    else:
        mm.allow_tf32 = True
    try:
        yield
    finally:
        if new_api:
            mm.fp32_precision = old
        else:
            mm.allow_tf32 = old


def stack(ts: list[Tensor], dim: int = 0) -> Tensor:
    """``torch.stack`` (a view, no copy, for one tensor)."""
    return ts[0].unsqueeze(dim) if len(ts) == 1 else torch.stack(ts, dim)


def pack(parts: list[list[Optional[Tensor]]], width: int, like: Tensor) -> Tensor:
    """``[L, *lead, width]``: row ``i`` holds ``parts[i]`` (tensors ``[*lead, n]``; a None is
    skipped, so only trailing ones keep the columns of the others) side by side from column
    0, zeros after them; one ``zeros`` and one ``_foreach_copy_`` whatever ``L``."""
    return pack_views(parts, width, like)[0]


def pack_views(parts: list[list[Optional[Tensor]]], width: int, like: Tensor) -> tuple[Tensor, list[Tensor]]:
    """:func:`pack`'s ``[L, *lead, width]`` and the views of it the parts were copied into
    (in row-major order: where a later set of parts of the same widths goes)."""
    ref = next(t for row in parts for t in row if t is not None)
    out = like.new_zeros(len(parts), *ref.shape[:-1], width)
    widths = [[t.shape[-1] if t is not None else None for t in row] for row in parts]
    views = column_views(out, widths)
    torch._foreach_copy_(views, [t for row in parts for t in row if t is not None])
    return out, views


def copy_new(dst: list[Tensor], src: list[Tensor]) -> None:
    """``_foreach_copy_(dst, src)`` but for the pairs whose source already is its destination
    (a record pointed at its slice of the stack, unchanged since: nothing to copy)."""
    pairs = [(d, t) for d, t in zip(dst, src)
             if not (d.data_ptr() == t.data_ptr() and d.shape == t.shape and d.stride() == t.stride())]
    if pairs:
        torch._foreach_copy_([d for d, _ in pairs], [t for _, t in pairs])


def column_views(out: Tensor, widths: list[list[Optional[int]]]) -> list[Tensor]:
    """Views of ``out [L, *lead, W]``: row ``i``'s parts of ``widths[i]`` side by side from
    column 0 (a None width is skipped), in row-major order: :func:`pack`'s layout."""
    views = []
    for i, row in enumerate(widths):
        off = 0
        for n in row:
            if n is not None:
                views.append(out[i, ..., off: off + n])
                off += n
    return views


@dataclass(eq=False)
class LayerGroup:
    """``L`` layers of one form and shape (module docstring). A subclass per form
    (:mod:`.group_forms`) holds that form's stacks and gives :meth:`stacks`, :meth:`gram`,
    :meth:`jvp`, :meth:`vjp` and the probe's coordinates, each product by the form's one
    kernel in :mod:`tengrad_fx.curvature`; this class holds what all forms share: the
    layers, the batch ``m``, the scale ``k``, the factors and the gradient plumbing."""

    form: ClassVar[str]
    layer_axis: ClassVar[int] = 0  # the stacks' layer axis ("conv": 1, after the sample axis)
    layers: list[CoveredLayer]
    m: int
    k: float = 1.0
    chol: Optional[Tensor] = None  # [L, m, m]: factors of K + mαI
    static: bool = False  # a captured CUDA graph reads this group's tensors: they keep their addresses
    _pairs: Optional[list[tuple[Tensor, Optional[Tensor]]]] = field(default=None, init=False, repr=False)
    _slices: Optional[list[tuple[Tensor, Optional[Tensor]]]] = field(default=None, init=False, repr=False)

    @property
    def cols(self) -> Optional[list[tuple[int, int]]]:
        """``(n_w, n_b)`` per layer of a packed group (:class:`.group_forms.PackedGroup`); None."""
        return None

    @property
    def has_bias(self) -> bool:
        """Whether the group has a bias stack (``Pb``, or ``B``'s bias part); packed: False."""
        return self.layers[0].bias is not None

    def stacks(self) -> tuple[Optional[Tensor], Optional[Tensor]]:
        """The group's pair of stacks: ``(Pw, Pb)`` for ``"P"``, ``(A, B)`` for ``"IG"`` and
        ``"conv"``; ``(None, None)`` for a form without stacks or a released group."""
        return None, None

    def release(self) -> None:
        """Drop the stacks (and what is made from them): afterwards only :attr:`layers`,
        :attr:`m`, :attr:`k` and :attr:`chol` are used (distributed ``gram-blocks`` keeps
        only the factor of the global records)."""

    def refill(self, parts: list[tuple[Tensor, Optional[Tensor]]]) -> None:
        """Copy a new capture's tensors of the same layers (``parts``: per layer ``(X, Y)``
        = ``(P_w, P_b)`` or ``(I, G)``, of the stacked shapes and dtypes) into this group's
        stacks, in place: no new stack, and the tensors (and the record views of
        :meth:`point_records`) keep their addresses, which a captured CUDA graph reads."""
        dim = self.layer_axis
        for j, S in enumerate(self.stacks()):
            if S is None:
                continue
            ts = [t for t in (pair[j] for pair in parts) if t is not None]
            copy_new(list(S.unbind(dim)), ts)  # the stack may be a strided view (of a record): any layout

    def point_records(self) -> None:
        """Point the store's records of layers captured as one call at their part of the
        stacks (:meth:`_layer_slice`, made once per group), so no second copy of ``P`` (or
        ``I``, ``G``) stays alive. Records whose ``P`` was formed here from ``I, G`` are
        left as they are."""
        X, Y = self.stacks()
        if X is None:
            return
        if self._slices is None:
            self._slices = [self._layer_slice(X, i, Y) for i in range(len(self.layers))]
        for lay, (x, y) in zip(self.layers, self._slices):
            recs = lay.records()
            if len(recs) != 1:
                continue
            self._point_record(recs[0], x, y)

    def _point_record(self, r: Any, x: Tensor, y: Optional[Tensor]) -> None:
        """Point one record at its layer's slices ``(x, y)`` of the stacks."""
        r.I, r.G = x, y

    def _layer_slice(self, X: Tensor, i: int, Y: Optional[Tensor] = None,
                     records: bool = True) -> tuple[Tensor, Optional[Tensor]]:
        """Layer ``i``'s parts of a pair of stacks ``(X, Y)``: ``(X[i], Y[i])``, for the
        records' stacks (``Pw, Pb``; ``A, B``) or, ``records=False``, a gradient or update
        pair ``(w [L, n_w], b [L, n_b])``."""
        return X[i], (Y[i] if Y is not None else None)

    # ------------------------------------------------------------------ gradients
    def grads(self) -> tuple[Tensor, Optional[Tensor]]:
        """``(gw [L, n_w], gb [L, n_b] or None)``; a missing ``.grad`` counts as zeros."""
        def one(p: Tensor) -> Tensor:  # flat: a "P" group may mix shapes of equal size
            return (p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
        pairs = self.param_pairs()
        gw = stack([one(w) for w, _ in pairs])
        gb = stack([one(b) for _, b in pairs if b is not None]) if self.has_bias else None
        return gw, gb

    def param_pairs(self) -> list[tuple[Tensor, Optional[Tensor]]]:
        """``(weight, bias)`` per layer, read from the modules once per group."""
        if self._pairs is None:
            self._pairs = [(lay.weight, lay.bias) for lay in self.layers]
        return self._pairs

    def sqnorms(self, gw: Tensor, gb: Optional[Tensor]) -> Tensor:
        """``‖g_l‖²`` per layer, ``[L]``: one read of the stacked gradients (batched dots)."""
        sq = torch.bmm(gw.unsqueeze(1), gw.unsqueeze(2)).view(-1)
        return sq if gb is None else sq + torch.bmm(gb.unsqueeze(1), gb.unsqueeze(2)).view(-1)

    def split(self, uw: Tensor, ub: Optional[Tensor]) -> dict[Tensor, Tensor]:
        """``{param: u}`` (views of the stacked ``uw``/``ub``) for parameters with a gradient."""
        out: dict[Tensor, Tensor] = {}
        for i, pair in enumerate(self.param_pairs()):
            for p, u in zip(pair, self._layer_slice(uw, i, ub, records=False)):
                if p is not None and p.grad is not None and u is not None:
                    out[p] = u.view(p.shape).to(p.dtype)
        return out

    # ------------------------------------------------------------------ J products
    def gram(self) -> Tensor:
        """``K = J Jᵀ``, ``[L, m, m]``; the scale ``k²`` rides in a GEMM's ``alpha`` (no pass
        over ``K``) where the form allows."""
        raise NotImplementedError

    def jvp(self, gw: Tensor, gb: Optional[Tensor]) -> Tensor:
        """``J g``, ``[L, m]``."""
        raise NotImplementedError

    def vjp(self, c: Tensor) -> tuple[Tensor, Optional[Tensor]]:
        """``Jᵀ c`` for ``c [L, m]``: ``(w [L, n_w], b [L, n_b] or None)``."""
        raise NotImplementedError

    def woodbury(self, c: Tensor, gw: Tensor, gb: Optional[Tensor], beta: Union[float, Tensor], gamma: float,
                 JTc: Optional[tuple[Tensor, Optional[Tensor]]] = None) -> tuple[Tensor, Optional[Tensor]]:
        """``u = β·g + γ·Jᵀc`` for ``c [L, m]``: ``(uw [L, n_w], ub [L, n_b] or None)``;
        ``β`` a float or ``[L]`` (one per layer, picked on the device). The Woodbury form
        ``(g − Jᵀc)/α`` is ``β = 1/α, γ = −1/α``; push-through ``s·Jᵀc`` is ``β = 0`` with
        ``c`` scaled by ``s`` (:func:`tengrad_fx.solve.woodbury_coefficients`).

        For stacked ``P`` (and a factored Linear's weight) one ``baddbmm`` per parameter
        computes it (a reuse step's whole per-group work after ``J g``). ``JTc``: ``Jᵀc``
        given, ``([L, n_w], [L, n_b] or None)`` (summed over the processes' rows where
        they are split, :class:`RowSplit`), combined with ``g`` as it is (``c`` unread)."""
        if isinstance(beta, Tensor):  # per layer: folded into g
            bw = beta.unsqueeze(1)
            gw, gb = gw * bw, (gb * bw if gb is not None else None)
            beta = 1.0
        if JTc is not None:
            return _combine(gw, gb, JTc, beta, gamma)
        return self._woodbury(c, gw, gb, beta, gamma)

    def _woodbury(self, c: Tensor, gw: Tensor, gb: Optional[Tensor], beta: float, gamma: float,
                  ) -> tuple[Tensor, Optional[Tensor]]:
        """:meth:`woodbury` with one float ``β``: by :meth:`vjp` (a form may fuse it)."""
        return _combine(gw, gb, self.vjp(c), beta, gamma)

    def probe(self, gw: Tensor, gb: Optional[Tensor], s: float, n_probe: int = 256) -> Tensor:
        """Is each layer's gradient the captured batch's ``s·Jᵀ1``? ``[L]`` bool, on the
        device (False after gradient clipping, a loss term outside the captured layers or
        accumulation): the form's coordinates (:mod:`.group_probe`) and the bias, by
        :func:`tengrad_fx.solve.push_through_holds`."""
        got, ref, got_b, ks = self._probe_terms(gw, s, n_probe)
        if got_b is not None and gb is not None:
            got, ref = torch.cat([got, got_b], 1), torch.cat([ref, gb], 1)
        return solve.push_through_holds(ref, got, ks)

    def _probe_terms(self, gw: Tensor, s: float, n_probe: int) -> ProbeTerms:
        """The probed coordinates of the form (:data:`.group_probe.ProbeTerms`)."""
        raise NotImplementedError

    def _full_probe_terms(self, gw: Tensor, s: float) -> ProbeTerms:
        """Every coordinate: the whole ``Jᵀ1`` by :meth:`vjp` (scaled already)."""
        got, got_b = self.vjp(torch.ones(gw.shape[0], self.m, dtype=gw.dtype, device=gw.device))
        return got, gw, got_b, s


Products = tuple[list[tuple[Tensor, Optional[Tensor]]], list[Tensor], list[Tensor]]
"""Per group ``(gw, gb)``, ``J g`` and ``‖g_l‖²`` (:func:`group_products`)."""


def group_products(groups: list[LayerGroup], M: int, sqnorms: bool = False) -> Products:
    """:func:`precondition`'s first pass: per group its gradients ``(gw [L, n_w], gb [L, n_b]
    or None)``, ``J g`` ``[L, M]`` (zero-padded rows; zeros for a group without rows in this
    process) and, with ``sqnorms``, ``‖g_l‖²`` ``[L]`` (else none)."""
    grads, jgs, sqs = [], [], []
    for grp in groups:
        gw, gb = grp.grads()
        Jg = grp.jvp(gw, gb) if grp.m else gw.new_zeros(len(grp.layers), 0)  # a process may hold no rows
        jgs.append(solve.pad_rows(Jg, M))
        if sqnorms:  # ‖g_l‖² per layer
            sqs.append(grp.sqnorms(gw, gb))
        grads.append((gw, gb))
    return grads, jgs, sqs


class RowSplit(Protocol):
    """The rows (samples) of :func:`precondition`'s groups split over processes, every
    process holding its own row block ``J_a`` of each layer's ``J``
    (:class:`tengrad_fx.distributed.gram_blocks.RowBlocks`): what differs from one process
    holding every row is where ``J g`` and the factors are, not the combination."""

    scale: float  # the push-through form's s·m (the whole batch's)
    products: Optional[Products]  # the groups' group_products, run already (its exchange started early); None

    def solve(self, groups: list[LayerGroup], grads: list[tuple[Tensor, Optional[Tensor]]], jgs: list[Tensor],
              use_pt: bool) -> tuple[Tensor, Optional[Tensor]]:
        """``(c [L_total, M], push [L_total] or None)``: this process's ``M`` rows (the most
        of any group, zero-padded) of ``(K + M_allαI)⁻¹ rhs`` (``rhs``: every process's
        ``J_a g``, ``jgs`` here, or ``1`` where the push-through probe holds, ``push``)."""
        ...

    def sum_vjps(self, groups: list[LayerGroup], cs: list[Tensor],
                 grads: list[tuple[Tensor, Optional[Tensor]]]) -> list[tuple[Tensor, Optional[Tensor]]]:
        """Per group ``Jᵀc = Σ_a J_aᵀ c_a`` (``cs``: this process's rows ``c_a [L, m]``)."""
        ...


def precondition(groups: list[LayerGroup], chol: Optional[Tensor], use_pt: bool, damping: Union[float, Tensor],
                 loss_reduction: str, dot: bool = False, sharding: Sharding = WHOLE,
                 rows: Optional[RowSplit] = None) -> tuple[dict[Tensor, Tensor], Optional[tuple[Tensor, Tensor]]]:
    """``({param: u}, dots)`` for every parameter with a gradient of ``groups`` (``chol``
    ``[L_total, M, M]``: their factors of ``K + mαI``, in group order, zero-padded to the
    most rows ``M``: :mod:`tengrad_fx.solve.ragged`): per group ``J g``,
    one solve for all layers, per group ``Jᵀ c``. With ``use_pt`` (empirical curvature
    steps) each layer takes the push-through form ``u = scale·Jᵀ(K + mαI)⁻¹1`` where its
    probe holds (picked on the device; ``J g`` is computed either way), else
    ``u = (g − Jᵀc)/α``.

    With ``dot``, ``dots = (Σ u·g, Σ ‖g‖²)`` over these parameters as device scalars (else
    None): the KL clip's ``Σ u·g`` comes from the ``m``-vectors, per layer ``u = β·g + γ·Jᵀc``
    giving ``u·g = β‖g‖² + γ·cᵀ(J g)``, so no pass over ``u`` (one read of ``g`` for
    ``‖g‖²``, which, finite, also certifies these gradients finite for the step's check).
    ``damping``: ``α``, or ``[L_total]`` (one per layer, group order).

    ``sharding``: groups over shards of their parameters (FSDP2's rows,
    :class:`tengrad_fx.distributed.shard_groups.ShardRows`) give partial sums of ``J g``
    and ``‖g‖²``, summed over the shards by :meth:`~..step.sharding.Sharding.sum_parts`
    (whole parameters: as they are). ``rows``: groups over row blocks of the samples
    (:class:`RowSplit`; ``chol`` None, no ``dot``): ``J g`` gathered, ``c`` solved and
    ``Jᵀc`` summed over the processes there; the coefficients and ``u`` as here."""
    per_layer = use_pt or isinstance(damping, Tensor)  # β differs per layer
    m = groups[0].m
    M = max(grp.m for grp in groups)  # fewer rows than M: zero-padded (solve.ragged)
    if use_pt and M != min(grp.m for grp in groups):
        raise ValueError("push-through needs every layer's rows to be the batch's samples")
    if rows is not None and dot:
        raise ValueError("precondition: the KL clip's dots need every row of c in this process (rows=None)")
    scale = solve.push_through_scale(m, loss_reduction) if rows is None else rows.scale
    grads, jgs, sqs = rows.products if rows is not None and rows.products is not None \
        else group_products(groups, M, dot and per_layer)
    jgs = sharding.sum_parts(jgs, "sum of the row shards' J g")
    if rows is None:
        c, push = _solve_here(groups, grads, jgs, chol, use_pt, scale)
    else:
        c, push = rows.solve(groups, grads, jgs, use_pt)
    # c = (K + mαI)⁻¹ rhs, [L_total, M]; per layer u = β·g + γ·Jᵀc
    c_all, beta_all, gamma = solve.woodbury_coefficients(c, damping, push, scale, grads[0][0].dtype)
    sizes = [len(grp.layers) for grp in groups]
    betas: list[Union[float, Tensor]] = list(beta_all.split(sizes)) if isinstance(beta_all, Tensor) \
        else [beta_all] * len(groups)
    dots = _update_dots(c_all, beta_all, jgs, sqs, grads, damping, sharding) if dot else None
    cs = [c if grp.m == M else c[..., :grp.m] for grp, c in zip(groups, c_all.split(sizes))]
    JTcs = rows.sum_vjps(groups, cs, grads) if rows is not None else [None] * len(groups)
    out: dict[Tensor, Tensor] = {}
    for grp, (gw, gb), beta, c, JTc in zip(groups, grads, betas, cs, JTcs):
        out.update(grp.split(*grp.woodbury(c, gw, gb, beta, gamma, JTc)))
    return out, dots


def _solve_here(groups: list[LayerGroup], grads: list[tuple[Tensor, Optional[Tensor]]], jgs: list[Tensor],
                chol: Optional[Tensor], use_pt: bool, scale: float) -> tuple[Tensor, Optional[Tensor]]:
    """:func:`precondition`'s ``(c, push)`` with every row in this process: the probe per
    group, one solve of all layers with the factors ``chol``."""
    assert chol is not None, "precondition: the factors of the groups solved here"
    rhs, push = jgs, []
    if use_pt:
        m = groups[0].m
        rhs = []
        for grp, (gw, gb), Jg in zip(groups, grads, jgs):
            ok = grp.probe(gw, gb, scale / m)
            push.append(ok)
            rhs.append(solve.push_through_rhs(Jg, ok))
    return solve.solve_cholesky(chol, torch.cat(rhs)), (torch.cat(push) if use_pt else None)


def _combine(gw: Tensor, gb: Optional[Tensor], JTc: tuple[Tensor, Optional[Tensor]], beta: float, gamma: float,
             ) -> tuple[Tensor, Optional[Tensor]]:
    """``β·g + γ·Jᵀc`` of a weight and bias stack (:func:`tengrad_fx.solve.woodbury_combine`)."""
    JTw, JTb = JTc
    uw = solve.woodbury_combine(gw, JTw, beta, gamma)
    ub = solve.woodbury_combine(gb, JTb, beta, gamma) if gb is not None and JTb is not None else None
    return uw, ub


def _update_dots(c_all: Tensor, beta_all: Union[float, Tensor], jgs: list[Tensor], sqs: list[Tensor],
                 grads: list[tuple[Tensor, Optional[Tensor]]], damping: Union[float, Tensor],
                 sharding: Sharding) -> tuple[Tensor, Tensor]:
    """:func:`precondition`'s ``(Σ u·g, Σ ‖g‖²)``: ``Σ_l β_l‖g_l‖² + γ·c_l·(J g)_l`` in the
    solve's dtype (``sqs``: each group's ``‖g_l‖²`` when ``β`` differs per layer, else empty)."""
    dt = c_all.dtype
    cJg = torch.dot(c_all.reshape(-1), torch.cat(jgs).to(dt).reshape(-1))
    if sqs:
        sq = sharding.sum_parts([torch.cat(sqs).to(dt)], "sum of the row shards' ‖g‖²")[0]
        return torch.dot(beta_all.to(dt), sq) + cJg, sq.sum()  # type: ignore[union-attr]
    # one β = 1/α, γ = −1/α: ‖g‖² of all stacks by one _foreach_norm
    a = 1.0 / float(damping)
    norms = torch.stack(torch._foreach_norm([t for gw_gb in grads for t in gw_gb if t is not None])).to(dt)
    gsq = sharding.sum_parts([torch.dot(norms, norms)], "sum of the row shards' ‖g‖²")[0]
    return torch.add(gsq * a, cJg, alpha=-a), gsq
