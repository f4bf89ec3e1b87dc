"""The per-step update of the ``gram-blocks`` layers of distributed TENGraD.

With ``W`` ranks of ``m`` samples, the global ``J`` (``[M, n]``, ``M = W·m``) is the
stack of the ranks' row blocks ``J_a`` (``[m, n]``), and ``K = J Jᵀ`` has the blocks
``K_ab = J_a J_bᵀ`` — for a Linear layer ``(I_a I_bᵀ + 1) ⊙ (G_a G_bᵀ)``, for a
convolution the same with the positions (the single-process factorization). The Gram is
formed where the layer is solved, from the ranks' ``I``, ``G`` (all-gathered, or gathered
to the owner: :mod:`.optimizer`); no per-sample gradient is ever sent, and afterwards
every rank keeps only its own records, i.e. its rows ``J_a``. Each step then runs
data-parallel (:class:`GramBlocksStep`)::

    rank a:  v_a = J_a g                       [m]    (its own rows; g: DDP's averaged gradient)
    all_gather(v_a)  ->  J g = [v_0; …; v_{W−1}]  [M]
    solver:  c = (K + MαI)⁻¹ J g               [M]    (the owner's cached factor; broadcast c)
    rank a:  s_a = J_aᵀ c_a                    [n]    (c_a: its m rows of c)
    all_reduce(s_a)  ->  Jᵀc = Σ_a s_a         [n]
    every rank:  u = (g − Jᵀc)/α

On empirical curvature steps the push-through form ``u = Jᵀ(K + MαI)⁻¹1`` is taken where
the probe holds (as in :func:`tengrad_fx.optim.tengrad_groups.precondition_groups`): the
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
from .comm import Bucket, broadcast_buckets, collective, pack, unpack

__all__ = ["GramBlocksStep", "N_PROBE"]

N_PROBE = 256  # weight coordinates of the push-through probe (plus the whole bias)


def _grads(lay: CoveredLayer) -> tuple[Tensor, Optional[Tensor]]:
    """``(g_w [weight shape], g_b [bias shape] or None)``; a missing ``.grad`` is zeros."""
    def one(p: Tensor) -> Tensor:
        return p.grad if p.grad is not None else torch.zeros_like(p)
    return one(lay.weight), (one(lay.bias) if lay.bias is not None else None)


def _solve(chol: Tensor, rhs: Tensor) -> Tensor:
    """``(L Lᵀ)⁻¹ rhs`` for ``chol = L`` ``[M, M]``, ``rhs [M]`` (two triangular solves)."""
    y = torch.linalg.solve_triangular(chol, rhs.to(chol.dtype).view(-1, 1), upper=False)
    return torch.linalg.solve_triangular(chol.mH, y, upper=True).view(-1)


class GramBlocksStep:
    """One step's ``u`` of the ``gram-blocks`` ``layers`` (the same list, in graph order,
    on every rank; the store holds each rank's own records), in three calls so that the
    caller can work while the collectives are in flight:

    * the constructor computes ``J_a g`` (and the probe's ``J_aᵀ1``) and starts the
      all-gather (async);
    * :meth:`exchange` waits for it, solves ``c`` where the factor is, broadcasts the
      owners' ``c`` (one bucket per owner), computes ``J_aᵀ c_a`` and starts the
      all-reduce of the partial sums (async);
    * :meth:`finish` waits for it and returns ``{param: u}``.

    Args:
        use_pt: an empirical curvature step (``update_form="auto"``): probe for push-through.
        generator: draws the probe coordinates (seeded alike on every rank).
        count: ``count(layer name, bytes)`` for the bytes this rank sends.
    """

    def __init__(self, layers: list[CoveredLayer], use_pt: bool, generator: torch.Generator,
                 count: Callable[[str, int], None]):
        self.layers, self.use_pt, self.count = layers, use_pt, count
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.m = layers[0].m
        dtype = layers[0].weight.dtype
        for lay in layers[1:]:
            dtype = torch.promote_types(dtype, lay.weight.dtype)
        self.dtype, self.device = dtype, layers[0].weight.device
        self.es = torch.empty((), dtype=dtype).element_size()
        self.grads: list[tuple[Tensor, Optional[Tensor]]] = []
        self.idxs: list[Optional[Tensor]] = []
        self.sizes: list[int] = []
        pieces = []
        for lay in layers:
            gw, gb = _grads(lay)
            part = [lay.jvp(gw, gb).to(dtype)]
            idx = None
            if use_pt:
                ones = torch.ones(self.m, dtype=_record_dtype(lay, dtype), device=self.device)
                pw, pb = lay.vjp(ones)
                idx = torch.randint(0, gw.numel(), (min(N_PROBE, gw.numel()),), generator=generator,
                                    device=self.device)
                part.append(pw.reshape(-1)[idx].to(dtype))
                if pb is not None:
                    part.append(pb.reshape(-1).to(dtype))
            piece = torch.cat(part)
            self.grads.append((gw, gb))
            self.idxs.append(idx)
            self.sizes.append(piece.numel())
            pieces.append(piece)
            count(lay.name, (self.world - 1) * piece.numel() * self.es)  # ring all-gather
        mine = torch.cat(pieces)
        self.parts = [torch.empty_like(mine) for _ in range(self.world)]
        self._gather = collective("all_gather of J g (gram-blocks)",
                                  lambda: dist.all_gather(self.parts, mine, async_op=True))
        self.push: list[Optional[Tensor]] = []
        self._reduce: Any = None

    def exchange(self, owner: dict[str, int], chol: dict[str, Tensor]) -> None:
        """``owner``: layer name -> the rank holding its factor (negative: every rank);
        ``chol``: the factors ``L`` (``[M, M]``, ``L Lᵀ = K + MαI``) held by this rank."""
        collective("waiting for J g (gram-blocks)", self._gather.wait)
        m, M, dtype, parts = self.m, self.world * self.m, self.dtype, self.parts
        tol = 1e-4 if dtype in (torch.float32, torch.float16, torch.bfloat16) else 1e-9
        cs: dict[str, Tensor] = {}
        off = 0
        for lay, (gw, gb), idx, size in zip(self.layers, self.grads, self.idxs, self.sizes):
            Jg = torch.cat([p[off: off + m] for p in parts])
            ok = None
            if self.use_pt:
                got = parts[0][off + m: off + size]
                for p in parts[1:]:
                    got = got + p[off + m: off + size]
                ref = gw.reshape(-1)[idx].to(dtype)
                if gb is not None:
                    ref = torch.cat([ref, gb.reshape(-1).to(dtype)])
                ok = torch.linalg.vector_norm(ref - got / M) <= tol * torch.linalg.vector_norm(ref)
                Jg = torch.where(ok, torch.ones_like(Jg), Jg)
            self.push.append(ok)
            off += size
            if lay.name in chol:
                cs[lay.name] = _solve(chol[lay.name], Jg)
        buckets: dict[int, Bucket] = {}
        for lay in self.layers:
            r = owner[lay.name]
            if r >= 0:
                buckets.setdefault(r, Bucket(r, dtype, self.device)).add(lay.name, torch.Size([M]))
                self.count(lay.name, M * self.es)  # pipelined broadcast: every rank sends c once
        blist = list(buckets.values())
        flats = [pack([cs[k] for k in b.keys], b) if b.rank == self.rank
                 else torch.empty(b.numel, dtype=dtype, device=self.device) for b in blist]
        broadcast_buckets(flats, blist, "the owners' c (gram-blocks)")
        for flat, b in zip(flats, blist):
            cs.update(zip(b.keys, unpack(flat, b)))
        partial, self.shapes = [], []
        for lay in self.layers:
            c_a = cs[lay.name][self.rank * m:(self.rank + 1) * m].to(_record_dtype(lay, dtype))
            w, b = lay.vjp(c_a)
            partial += [w.reshape(-1).to(dtype)] + ([b.reshape(-1).to(dtype)] if b is not None else [])
            self.shapes.append((w.numel(), b.numel() if b is not None else 0))
            n = sum(self.shapes[-1])
            self.count(lay.name, int(2 * (self.world - 1) / self.world * n * self.es))  # ring all-reduce
        self.total = torch.cat(partial)
        self._reduce = collective("all_reduce of the Jᵀc partial sums (gram-blocks)",
                                  lambda: dist.all_reduce(self.total, async_op=True))

    def finish(self, damping: float) -> dict[Tensor, Tensor]:
        """``{param: u}``: ``(g − Jᵀc)/α``, or ``Jᵀc`` where the push-through probe holds."""
        collective("waiting for Jᵀc (gram-blocks)", self._reduce.wait)
        out: dict[Tensor, Tensor] = {}
        off = 0
        a = 1.0 / damping
        for lay, (gw, gb), ok, (nw, nb) in zip(self.layers, self.grads, self.push, self.shapes):
            for p, g, k in ((lay.weight, gw, nw), (lay.bias, gb, nb)):
                if p is None or g is None or k == 0:
                    continue
                JTc = self.total[off: off + k].view(g.shape).to(g.dtype)
                off += k
                u = (g - JTc) * a
                if ok is not None:  # push-through where the probe holds (scale 1: mean loss)
                    u = torch.where(ok, JTc, u)
                if p.grad is not None:
                    out[p] = u.to(p.dtype)
        return out


def _record_dtype(lay: CoveredLayer, default: torch.dtype) -> torch.dtype:
    G = lay.records()[0].G
    return G.dtype if G is not None else default
