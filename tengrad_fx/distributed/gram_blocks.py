"""The per-step update of the ``gram-blocks`` layers of distributed TENGraD.

With ``W`` ranks of ``m`` samples, the global ``J`` (``[M, n]``, ``M = W·m``) is the
stack of the ranks' row blocks ``J_a`` (``[m, n]``), and ``K = J Jᵀ`` has the blocks
``K_ab = J_a J_bᵀ`` — for a Linear layer ``(I_a I_bᵀ + 1) ⊙ (G_a G_bᵀ)``
(:func:`tengrad_fx.curvature.factored.gram` of the two row sets), for a convolution the
same with the positions (the single-process factorization). The Gram is
formed where the layer is solved, from the ranks' ``I``, ``G`` (all-gathered, or gathered
to the owner: :mod:`.optimizer`); no per-sample gradient is ever sent, and afterwards
every rank keeps only its own records, i.e. its rows ``J_a``. The Gram (all blocks at
once), ``J_a g`` and ``J_aᵀ c_a`` are the layer groups' products, i.e. each form's one
kernel in :mod:`tengrad_fx.curvature`, as on a single process. Each step then runs
data-parallel, through the one Woodbury apply
(:func:`tengrad_fx.optim.tengrad.layer_groups.precondition` with :class:`RowBlocks`, which
moves the rows; the coefficients and the combination are the apply's)::

    rank a:  v_a = J_a g                       [m]    (its own rows; g: DDP's averaged gradient)
    all_gather(v_a)  ->  J g = [v_0; …; v_{W−1}]  [M]
    solver:  c = (K + MαI)⁻¹ J g               [M]    (the owner's cached factor; broadcast c)
    rank a:  s_a = J_aᵀ c_a                    [n]    (c_a: its m rows of c)
    all_reduce(s_a)  ->  Jᵀc = Σ_a s_a         [n]
    every rank:  u = (g − Jᵀc)/α

On empirical curvature steps the push-through form ``u = Jᵀ(K + MαI)⁻¹1`` is taken where
the probe holds (as in :func:`tengrad_fx.optim.tengrad.layer_groups.precondition`): the
probe compares ``g`` on a few random coordinates (the same on every rank: a generator
seeded alike) with ``(1/M)·Σ_a J_aᵀ1`` there, whose per-rank parts travel in the same
all-gather as ``J_a g``. Every rank sums the gathered parts in rank order, so every rank
takes the same decision and the same ``u`` bit for bit.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from ..curvature.layer import CoveredLayer
from ..optim.tengrad.layer_groups import LayerGroup, Products, group_products
from .. import solve
from .comm import Bucket, all_gather_meta, broadcast_buckets, collective, pack, unpack
from .traffic import all_gather_sent, all_reduce_sent, broadcast_sent

__all__ = ["N_PROBE", "RowBlocks", "rows_by_group"]

N_PROBE = 256  # weight coordinates of the push-through probe (plus the whole bias)

Grads = list[tuple[Tensor, Optional[Tensor]]]
Gathering = tuple[list[Tensor], list[Optional[Tensor]], list[int], Any]


class RowBlocks:
    """The ``gram-blocks`` layers' rows split over the ranks, for
    :func:`~tengrad_fx.optim.tengrad.layer_groups.precondition` (its
    :class:`~tengrad_fx.optim.tengrad.layer_groups.RowSplit`): the groups are
    :class:`~tengrad_fx.optim.tengrad.layer_groups.LayerGroup` s over each rank's own
    records (the same groups, in the same order, on every rank: one batched ``J g`` /
    ``Jᵀ c`` per group of equal shapes).

    * :meth:`start` (optional): ``J_a g`` (and the probe's ``J_aᵀ1``) and their all-gather
      started (async), so the caller works while they travel;
    * :meth:`solve`: that all-gather (started here without :meth:`start`), the probe, ``c``
      solved where the factor is, one broadcast of the owners' ``c`` per owner;
    * :meth:`sum_vjps`: ``J_aᵀ c_a`` and one all-reduce of the partial sums.

    Args:
        owner: layer name -> the rank holding its factor (negative: every rank).
        chol: the factors ``L`` (``[M, M]``, ``L Lᵀ = K + MαI``) held by this rank, by layer name.
        generator: draws the probe coordinates (seeded alike on every rank; needed with ``use_pt``).
        count: ``count(layer name, bytes)`` for the bytes this rank sends.
        rows: per group, each rank's rows (``curvature_samples``, ``position_rows``: each rank's
            part of the ``k``); None: ``m`` on every rank. A rank's ``J_a g`` travels
            zero-padded to the most rows of any rank.
    """

    scale = 1.0  # push-through: u = Jᵀ(K + MαI)⁻¹1 for the global batch's mean loss
    products: Optional[Products] = None  # the groups' group_products, from start

    def __init__(self, owner: dict[str, int], chol: dict[str, Tensor], generator: Optional[torch.Generator],
                 count: Callable[[str, int], None], rows: Optional[list[list[int]]] = None):
        self.owner, self.chol, self.generator, self.count, self.rows = owner, chol, generator, count, rows
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.dtype, self.device, self.es = torch.float32, torch.device("cpu"), 4
        self._gathering: Optional[Gathering] = None

    def start(self, groups: list[LayerGroup], use_pt: bool) -> None:
        """:func:`~tengrad_fx.optim.tengrad.layer_groups.group_products` of ``groups`` (kept in
        :attr:`products` for the apply) and their ``J_a g``'s all-gather started."""
        self.products = grads, jgs, _ = group_products(groups, max(grp.m for grp in groups))
        self._gathering = self._gather(groups, grads, jgs, self._setup(groups), use_pt)

    def _setup(self, groups: list[LayerGroup]) -> list[list[int]]:
        """The groups' dtype (the weights' promoted: what travels), device and rows."""
        dtype = groups[0].layers[0].weight.dtype
        for grp in groups:
            for lay in grp.layers:
                dtype = torch.promote_types(dtype, lay.weight.dtype)
        self.dtype, self.device = dtype, groups[0].layers[0].weight.device
        self.es = torch.empty((), dtype=dtype).element_size()
        return self.rows if self.rows is not None else [[grp.m] * self.world for grp in groups]

    def solve(self, groups: list[LayerGroup], grads: Grads, jgs: list[Tensor],
              use_pt: bool) -> tuple[Tensor, Optional[Tensor]]:
        """``(c, push)``: this rank's rows of ``c = (K + MαI)⁻¹ rhs`` per layer ``[L_total, m]``
        (``m``: the most of any group here, zero-padded; in the travelling dtype) and the
        probe's ``[L_total]`` flags (None without ``use_pt``). ``jgs``: per group ``J_a g``."""
        rows = self._setup(groups)
        parts, idxs, widths, work = self._gathering or self._gather(groups, grads, jgs, rows, use_pt)
        collective("waiting for J g (gram-blocks)", work.wait)
        cs: dict[str, Tensor] = {}
        push: list[Tensor] = []
        off = 0
        for grp, (gw, gb), idx, width, rows_g in zip(groups, grads, idxs, widths, rows):
            L, R, M = len(grp.layers), max(rows_g), sum(rows_g)
            views = [p[off: off + L * width].view(L, width) for p in parts]
            off += L * width
            Jg = torch.cat([v[:, :r] for v, r in zip(views, rows_g)], 1)  # [L, M]: the ranks' rows in rank order
            if use_pt:
                got = views[0][:, R:]
                for v in views[1:]:
                    got = got + v[:, R:]
                ref = gw[:, idx].to(self.dtype)
                if gb is not None and width > R + ref.shape[1]:
                    ref = torch.cat([ref, gb.to(self.dtype)], 1)
                ok = solve.push_through_holds(ref, got, 1.0 / M)  # [L]
                push.append(ok)
                Jg = solve.push_through_rhs(Jg, ok)
            for i, lay in enumerate(grp.layers):
                if lay.name in self.chol:  # a factor padded to the most rows of any layer (solve.ragged): pad, cut
                    factor = self.chol[lay.name]
                    cs[lay.name] = solve.solve_cholesky(factor, solve.pad_rows(Jg[i], factor.shape[-1]))[:M]
        self._share(groups, rows, cs)
        m = max(grp.m for grp in groups)
        mine = []
        for grp, rows_g in zip(groups, rows):
            first = sum(rows_g[:self.rank])
            for lay in grp.layers:  # this rank's rows of c
                mine.append(solve.pad_rows(cs[lay.name][first: first + rows_g[self.rank]].to(self.dtype), m))
        return torch.stack(mine), (torch.cat(push) if use_pt else None)

    def _gather(self, groups: list[LayerGroup], grads: Grads, jgs: list[Tensor], rows: list[list[int]],
                use_pt: bool) -> Gathering:
        """Every rank's ``J_a g`` (and the probe's ``J_aᵀ1`` on coordinates drawn alike on
        every rank) by one all-gather, started: ``(each rank's flat part, the probe
        coordinates per group, the values per layer of each group, its handle)``."""
        pieces: list[Tensor] = []
        idxs: list[Optional[Tensor]] = []
        widths: list[int] = []
        for grp, (gw, gb), Jg, rows_g in zip(groups, grads, jgs, rows):
            L = len(grp.layers)
            part = [torch.nn.functional.pad(Jg[:, :grp.m].to(self.dtype), (0, max(rows_g) - grp.m))]
            idx = None
            if use_pt:
                ones = torch.ones(L, grp.m, dtype=_record_dtype(grp.layers[0], self.dtype), device=self.device)
                pw, pb = grp.vjp(ones)
                idx = torch.randint(0, gw.shape[1], (min(N_PROBE, gw.shape[1]),), generator=self.generator,
                                    device=self.device)
                part.append(pw[:, idx].to(self.dtype))
                if pb is not None and gb is not None:
                    part.append(pb.to(self.dtype))
            piece = torch.cat(part, 1)  # [L, width]
            idxs.append(idx)
            widths.append(piece.shape[1])
            pieces.append(piece.reshape(-1))
            for lay in grp.layers:
                self.count(lay.name, int(all_gather_sent(piece.shape[1] * self.es, self.world)))
        mine = torch.cat(pieces)
        parts = [torch.empty_like(mine) for _ in range(self.world)]
        work = collective("all_gather of J g (gram-blocks)", lambda: dist.all_gather(parts, mine, async_op=True))
        return parts, idxs, widths, work

    def _share(self, groups: list[LayerGroup], rows: list[list[int]], cs: dict[str, Tensor]) -> None:
        """The owners' ``c`` into ``cs`` on every rank (one bucketed broadcast per owner)."""
        buckets: dict[int, Bucket] = {}
        for grp, rows_g in zip(groups, rows):
            for lay in grp.layers:
                r = self.owner[lay.name]
                if r >= 0:
                    buckets.setdefault(r, Bucket(r, self.dtype, self.device)).add(lay.name, torch.Size([sum(rows_g)]))
                    self.count(lay.name, int(broadcast_sent(sum(rows_g) * self.es)))
        blist = list(buckets.values())
        flats = [pack([cs[k] for k in b.keys], b) if b.rank == self.rank
                 else torch.empty(b.numel, dtype=self.dtype, device=self.device) for b in blist]
        broadcast_buckets(flats, blist, "the owners' c (gram-blocks)")
        for flat, b in zip(flats, blist):
            cs.update(zip(b.keys, unpack(flat, b)))

    def sum_vjps(self, groups: list[LayerGroup], cs: list[Tensor],
                 grads: Grads) -> list[tuple[Tensor, Optional[Tensor]]]:
        """Per group ``Jᵀc = Σ_a J_aᵀ c_a`` (``cs``: this rank's rows ``[L, m]``): one
        all-reduce of every group's partial sums, in the travelling dtype."""
        partial, shapes = [], []
        for grp, C, (gw, gb) in zip(groups, cs, grads):
            jw, jb = grp.vjp(C.to(_record_dtype(grp.layers[0], self.dtype))) if grp.m else \
                (torch.zeros_like(gw), None if gb is None else torch.zeros_like(gb))  # J_aᵀ c_a: [L, n_w], [L, n_b]
            partial += [jw.to(self.dtype).reshape(-1)] + ([jb.to(self.dtype).reshape(-1)] if jb is not None else [])
            shapes.append((jw.shape, jb.shape if jb is not None else None))
            n = jw.shape[1] + (jb.shape[1] if jb is not None else 0)
            for lay in grp.layers:
                self.count(lay.name, int(all_reduce_sent(n * self.es, self.world)))
        total = torch.cat(partial)
        work = collective("all_reduce of the Jᵀc partial sums (gram-blocks)",
                          lambda: dist.all_reduce(total, async_op=True))
        collective("waiting for Jᵀc (gram-blocks)", work.wait)
        out: list[tuple[Tensor, Optional[Tensor]]] = []
        off = 0
        for sw, sb in shapes:
            jw = total[off: off + sw.numel()].view(sw)
            off += sw.numel()
            jb = None
            if sb is not None:
                jb = total[off: off + sb.numel()].view(sb)
                off += sb.numel()
            out.append((jw, jb))
        return out


def rows_by_group(groups: list[LayerGroup]) -> Optional[list[list[int]]]:
    """Per group of this rank's records, each rank's rows (``curvature_samples``,
    ``position_rows``: its part of the ``k``; a host exchange); None where the ranks' groups
    do not hold the same layers in the same order (the cost model chose other forms for
    other row counts, e.g. on a rank that holds none of the rows: same on every rank)."""
    mine = [([lay.name for lay in grp.layers], grp.m) for grp in groups]
    every = all_gather_meta(mine, "exchange of the gram-blocks rows")
    if any([names for names, _ in other] != [names for names, _ in mine] for other in every):
        return None
    return [[other[g][1] for other in every] for g in range(len(mine))]


def _record_dtype(lay: CoveredLayer, default: torch.dtype) -> torch.dtype:
    G = lay.records()[0].G
    return G.dtype if G is not None else default
