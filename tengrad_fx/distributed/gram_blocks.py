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
data-parallel (:class:`GramBlocksStep`)::

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

from typing import Any, Callable, Optional, Union

import torch
import torch.distributed as dist
from torch import Tensor

from ..curvature.layer import CoveredLayer
from ..optim.tengrad.layer_groups import LayerGroup
from .. import solve
from .comm import Bucket, all_gather_meta, broadcast_buckets, collective, pack, unpack
from .traffic import all_gather_sent, all_reduce_sent, broadcast_sent

__all__ = ["GramBlocksStep", "N_PROBE", "rows_by_group"]

N_PROBE = 256  # weight coordinates of the push-through probe (plus the whole bias)


class GramBlocksStep:
    """One step's ``u`` of the ``gram-blocks`` layers, given as
    :class:`~tengrad_fx.optim.tengrad.layer_groups.LayerGroup` s over each rank's own records
    (the same groups, in the same order, on every rank: one batched ``J g`` / ``Jᵀ c`` per
    group of equal shapes), in three calls so that the caller can work while the
    collectives are in flight:

    * the constructor computes ``J_a g`` (and the probe's ``J_aᵀ1``) and starts the
      all-gather (async);
    * :meth:`exchange` waits for it, solves ``c`` where the factor is, broadcasts the
      owners' ``c`` (one bucket per owner), computes ``J_aᵀ c_a`` and starts the
      all-reduce of the partial sums (async);
    * :meth:`finish` waits for it and returns ``{param: u}``.

    Args:
        groups: the gram-blocks layers' groups of local records (``m`` rows each).
        use_pt: an empirical curvature step (``update_form="auto"``): probe for push-through.
        generator: draws the probe coordinates (seeded alike on every rank; needed with ``use_pt``).
        count: ``count(layer name, bytes)`` for the bytes this rank sends.
        rows: per group, each rank's rows (``curvature_samples``, ``position_rows``: each rank's
            part of the ``k``); None: ``m`` on every rank. A rank's ``J_a g`` travels
            zero-padded to the most rows of any rank.
    """

    def __init__(self, groups: list[LayerGroup], use_pt: bool, generator: Optional[torch.Generator],
                 count: Callable[[str, int], None], rows: Optional[list[list[int]]] = None):
        self.groups, self.use_pt, self.count = groups, use_pt, count
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.rows = rows if rows is not None else [[grp.m] * self.world for grp in groups]
        dtype = groups[0].layers[0].weight.dtype
        for grp in groups:
            for lay in grp.layers:
                dtype = torch.promote_types(dtype, lay.weight.dtype)
        self.dtype, self.device = dtype, groups[0].layers[0].weight.device
        self.es = torch.empty((), dtype=dtype).element_size()
        self.grads: list[tuple[Tensor, Optional[Tensor]]] = []
        self.idxs: list[Optional[Tensor]] = []
        self.widths: list[int] = []  # values per layer of the group in the all-gather
        pieces = []
        for grp, rows_g in zip(groups, self.rows):
            L = len(grp.layers)
            gw, gb = grp.grads()  # [L, n_w], [L, n_b]
            Jg = grp.jvp(gw, gb).to(dtype) if grp.m else gw.new_zeros(L, 0, dtype=dtype)  # [L, m]
            part = [torch.nn.functional.pad(Jg, (0, max(rows_g) - grp.m))]  # [L, max rows]
            idx = None
            if use_pt:
                ones = torch.ones(L, grp.m, dtype=_record_dtype(grp.layers[0], dtype), device=self.device)
                pw, pb = grp.vjp(ones)
                idx = torch.randint(0, gw.shape[1], (min(N_PROBE, gw.shape[1]),), generator=generator,
                                    device=self.device)
                part.append(pw[:, idx].to(dtype))
                if pb is not None and gb is not None:
                    part.append(pb.to(dtype))
            piece = torch.cat(part, 1)  # [L, width]
            self.grads.append((gw, gb))
            self.idxs.append(idx)
            self.widths.append(piece.shape[1])
            pieces.append(piece.reshape(-1))
            for lay in grp.layers:
                count(lay.name, int(all_gather_sent(piece.shape[1] * self.es, self.world)))
        mine = torch.cat(pieces)
        self.parts = [torch.empty_like(mine) for _ in range(self.world)]
        self._gather = collective("all_gather of J g (gram-blocks)",
                                  lambda: dist.all_gather(self.parts, mine, async_op=True))
        self.push: list[Optional[Tensor]] = []
        self._reduce: Any = None

    def exchange(self, owner: dict[str, int], chol: dict[str, Tensor], damping: Union[float, dict[str, Any]]) -> None:
        """``owner``: layer name -> the rank holding its factor (negative: every rank);
        ``chol``: the factors ``L`` (``[M, M]``, ``L Lᵀ = K + MαI``) held by this rank;
        ``damping``: ``α``, or each layer's by name (a float, or a float64 scalar tensor:
        :func:`.dampings.block_dampings`)."""
        collective("waiting for J g (gram-blocks)", self._gather.wait)
        dtype = self.dtype
        cs: dict[str, Tensor] = {}
        off = 0
        for grp, (gw, gb), idx, width, rows_g in zip(self.groups, self.grads, self.idxs, self.widths, self.rows):
            L, R, M = len(grp.layers), max(rows_g), sum(rows_g)
            views = [p[off: off + L * width].view(L, width) for p in self.parts]
            off += L * width
            Jg = torch.cat([v[:, :r] for v, r in zip(views, rows_g)], 1)  # [L, M]: the ranks' rows in rank order
            ok = None
            if self.use_pt:
                got = views[0][:, R:]
                for v in views[1:]:
                    got = got + v[:, R:]
                ref = gw[:, idx].to(dtype)
                if gb is not None and width > R + ref.shape[1]:
                    ref = torch.cat([ref, gb.to(dtype)], 1)
                ok = solve.push_through_holds(ref, got, 1.0 / M)  # [L]
                Jg = solve.push_through_rhs(Jg, ok)
            self.push.append(ok)
            for i, lay in enumerate(grp.layers):
                if lay.name in chol:  # a factor padded to the most rows of any layer (solve.ragged): pad, cut
                    factor = chol[lay.name]
                    cs[lay.name] = solve.solve_cholesky(factor, solve.pad_rows(Jg[i], factor.shape[-1]))[:M]
        buckets: dict[int, Bucket] = {}
        for grp, rows_g in zip(self.groups, self.rows):
            for lay in grp.layers:
                r = owner[lay.name]
                if r >= 0:
                    buckets.setdefault(r, Bucket(r, dtype, self.device)).add(lay.name, torch.Size([sum(rows_g)]))
                    self.count(lay.name, int(broadcast_sent(sum(rows_g) * self.es)))
        blist = list(buckets.values())
        flats = [pack([cs[k] for k in b.keys], b) if b.rank == self.rank
                 else torch.empty(b.numel, dtype=dtype, device=self.device) for b in blist]
        broadcast_buckets(flats, blist, "the owners' c (gram-blocks)")
        for flat, b in zip(flats, blist):
            cs.update(zip(b.keys, unpack(flat, b)))
        partial, self.shapes, self.coefs = [], [], []
        for grp, ok, (gw, gb), rows_g in zip(self.groups, self.push, self.grads, self.rows):
            first = sum(rows_g[:self.rank])
            rows = slice(first, first + rows_g[self.rank])  # this rank's rows of c
            # u = β·g + γ·Jᵀc' per layer (push-through scale 1: mean loss), alike on every rank
            alpha = damping if not isinstance(damping, dict) else \
                torch.stack([torch.as_tensor(damping[lay.name], dtype=torch.float64) for lay in grp.layers])
            C, beta, gamma = solve.woodbury_coefficients(torch.stack([cs[lay.name][rows] for lay in grp.layers]),
                                                         alpha, ok, 1.0, gw.dtype)  # C: [L, m]
            self.coefs.append((beta, gamma))
            jw, jb = grp.vjp(C.to(_record_dtype(grp.layers[0], dtype))) if grp.m else \
                (torch.zeros_like(gw), None if gb is None else torch.zeros_like(gb))  # J_aᵀ c_a: [L, n_w], [L, n_b]
            partial += [jw.to(dtype).reshape(-1)] + ([jb.to(dtype).reshape(-1)] if jb is not None else [])
            self.shapes.append((jw.shape, jb.shape if jb is not None else None))
            n = jw.shape[1] + (jb.shape[1] if jb is not None else 0)
            for lay in grp.layers:
                self.count(lay.name, int(all_reduce_sent(n * self.es, self.world)))
        self.total = torch.cat(partial)
        self._reduce = collective("all_reduce of the Jᵀc partial sums (gram-blocks)",
                                  lambda: dist.all_reduce(self.total, async_op=True))

    def finish(self) -> dict[Tensor, Tensor]:
        """``{param: u}``: ``(g − Jᵀc)/α``, or ``Jᵀc`` where the push-through probe holds
        (:func:`tengrad_fx.solve.woodbury_coefficients` picked ``c``, ``β`` and ``γ``)."""
        collective("waiting for Jᵀc (gram-blocks)", self._reduce.wait)
        out: dict[Tensor, Tensor] = {}
        off = 0
        for grp, (gw, gb), (beta, gamma), (sw, sb) in zip(self.groups, self.grads, self.coefs, self.shapes):
            us: list[Optional[Tensor]] = []
            for g, shape in ((gw, sw), (gb, sb)):
                if shape is None:
                    us.append(None)
                    continue
                k = shape.numel()
                JTc = self.total[off: off + k].view(shape)
                off += k
                us.append(solve.woodbury_combine(g, JTc, beta, gamma) if g is not None else None)
            uw, ub = us
            assert uw is not None, "every group has a weight part"
            out.update(grp.split(uw, ub))
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
