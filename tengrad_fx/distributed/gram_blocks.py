"""The per-step update of the ``gram-blocks`` layers of distributed TENGraD.

With ``W`` ranks of ``m`` samples, the global ``J`` (``[M, n]``, ``M = W·m``) is the
stack of the ranks' row blocks ``J_a`` (``[m, n]``), and ``K = J Jᵀ`` has the blocks
``K_ab = J_a J_bᵀ`` — for a Linear layer ``(I_a I_bᵀ + 1) ⊙ (G_a G_bᵀ)``, for a
convolution the same with the positions (the single-process factorization). The Gram is
formed where the layer is solved, from the ranks' ``I``, ``G`` (all-gathered, or gathered
to the owner: :mod:`.optimizer`); no per-sample gradient is ever sent, and afterwards
every rank keeps only its own records, i.e. its rows ``J_a``. Each step then runs
data-parallel (:func:`blocks_updates`)::

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

from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from ..curvature.layer import CoveredLayer
from .comm import Bucket, broadcast_buckets, collective, pack, unpack

__all__ = ["blocks_updates", "N_PROBE"]

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


def blocks_updates(layers: list[CoveredLayer], owner: dict[str, int], chol: dict[str, Tensor], use_pt: bool,
                   damping: float, generator: torch.Generator,
                   count: Callable[[str, int], None]) -> dict[Tensor, Tensor]:
    """``{param: u}`` of every parameter with a gradient of the ``gram-blocks`` ``layers``
    (the same list, in graph order, on every rank; the store holds each rank's own records).

    Args:
        owner: layer name -> the rank holding its factor, or a negative value when every
            rank holds it (``placement="replicate"``: no ``c`` is broadcast).
        chol: the factors ``L`` (``[M, M]``, ``L Lᵀ = K + MαI``) held by this rank.
        use_pt: an empirical curvature step (``update_form="auto"``): probe for push-through.
        generator: draws the probe coordinates (seeded alike on every rank).
        count: ``count(layer name, bytes)`` for the bytes this rank sends.
    """
    if not layers:
        return {}
    rank, world = dist.get_rank(), dist.get_world_size()
    m = layers[0].m
    M = world * m
    dtype = layers[0].weight.dtype
    for lay in layers[1:]:
        dtype = torch.promote_types(dtype, lay.weight.dtype)
    device = layers[0].weight.device
    es = torch.empty((), dtype=dtype).element_size()
    # 1. J_a g (and the probe's J_aᵀ1 on sampled coordinates) -> one all-gather
    grads, idxs, pieces, sizes = [], [], [], []
    for lay in layers:
        gw, gb = _grads(lay)
        part = [lay.jvp(gw, gb).to(dtype)]
        idx = None
        if use_pt:
            ones = torch.ones(m, dtype=lay.records()[0].G.dtype if lay.records()[0].G is not None else dtype,
                              device=device)
            pw, pb = lay.vjp(ones)
            idx = torch.randint(0, gw.numel(), (min(N_PROBE, gw.numel()),), generator=generator, device=device)
            part.append(pw.reshape(-1)[idx].to(dtype))
            if pb is not None:
                part.append(pb.reshape(-1).to(dtype))
        flat_part = torch.cat(part)
        grads.append((gw, gb))
        idxs.append(idx)
        pieces.append(flat_part)
        sizes.append(flat_part.numel())
        count(lay.name, (world - 1) * flat_part.numel() * es)  # ring all-gather
    mine = torch.cat(pieces)
    parts = [torch.empty_like(mine) for _ in range(world)]
    collective("all_gather of J g (gram-blocks)", lambda: dist.all_gather(parts, mine))
    # 2. every rank: J g, the probe decision; solvers: c
    tol = 1e-4 if dtype in (torch.float32, torch.float16, torch.bfloat16) else 1e-9
    push: list[Optional[Tensor]] = []
    cs: dict[str, Tensor] = {}
    off = 0
    for lay, (gw, gb), idx, size in zip(layers, grads, idxs, sizes):
        Jg = torch.cat([p[off: off + m] for p in parts])
        ok = None
        if use_pt:
            got = parts[0][off + m: off + size]
            for p in parts[1:]:
                got = got + p[off + m: off + size]
            ref = gw.reshape(-1)[idx].to(dtype)
            if gb is not None:
                ref = torch.cat([ref, gb.reshape(-1).to(dtype)])
            ok = torch.linalg.vector_norm(ref - got / M) <= tol * torch.linalg.vector_norm(ref)
            Jg = torch.where(ok, torch.ones_like(Jg), Jg)
        push.append(ok)
        off += size
        if lay.name in chol:
            cs[lay.name] = _solve(chol[lay.name], Jg)
    # 3. the owners' c to every rank (one bucketed broadcast per owner)
    buckets: dict[int, Bucket] = {}
    for lay in layers:
        r = owner[lay.name]
        if r >= 0:
            buckets.setdefault(r, Bucket(r, dtype, device)).add(lay.name, torch.Size([M]))
            count(lay.name, M * es)  # pipelined broadcast: every rank sends c once
    blist = list(buckets.values())
    flats = [pack([cs[k] for k in b.keys], b) if b.rank == rank else torch.empty(b.numel, dtype=dtype, device=device)
             for b in blist]
    broadcast_buckets(flats, blist)
    for flat, b in zip(flats, blist):
        cs.update(zip(b.keys, unpack(flat, b)))
    # 4. J_aᵀ c_a on this rank's rows -> one all-reduce of the partial sums
    partial, shapes = [], []
    for lay in layers:
        rec_dtype = lay.records()[0].G.dtype if lay.records()[0].G is not None else dtype
        w, b = lay.vjp(cs[lay.name][rank * m:(rank + 1) * m].to(rec_dtype))
        partial += [w.reshape(-1).to(dtype)] + ([b.reshape(-1).to(dtype)] if b is not None else [])
        shapes.append((w.numel(), b.numel() if b is not None else 0))
        n = w.numel() + shapes[-1][1]
        count(lay.name, int(2 * (world - 1) / world * n * es))  # ring all-reduce
    total = torch.cat(partial)
    collective("all_reduce of the Jᵀc partial sums (gram-blocks)", lambda: dist.all_reduce(total))
    # 5. u on every rank
    out: dict[Tensor, Tensor] = {}
    off = 0
    a = 1.0 / damping
    for lay, (gw, gb), ok, (nw, nb) in zip(layers, grads, push, shapes):
        for p, g, k in ((lay.weight, gw, nw), (lay.bias, gb, nb)):
            if p is None or g is None or k == 0:
                continue
            JTc = total[off: off + k].view(g.shape).to(g.dtype)
            off += k
            u = (g - JTc) * a
            if ok is not None:  # push-through where the probe holds (scale 1: mean loss)
                u = torch.where(ok, JTc, u)
            if p.grad is not None:
                out[p] = u.to(p.dtype)
    return out
