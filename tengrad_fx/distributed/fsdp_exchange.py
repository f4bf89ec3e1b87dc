"""The records of FSDP2 ``gram-blocks`` layers: each rank receives, from every
data-parallel rank, only the part of its records that its own rows need.

Rank ``d`` holds rows ``R_d`` of a layer's weight; the per-sample gradients restricted to
``R_d`` need the records cut to ``R_d`` (:func:`.fsdp_rows.cut`: for Linear ``I`` and
``G[..., R_d]``, so ``1/S`` of ``G``; for a transposed Linear ``I[..., R_d]`` and ``G``; a
transposed convolution ``I[:, R_d]`` and ``G``, or with groups their output channels). A
transposed layer's bias, sharded apart (rows ``R'_d`` of its output features or channels),
travels as its rows' per-sample gradients ``[m, |R'_d|]`` (:func:`.fsdp_rows.cut_bias`).
Every rank cuts its ``m`` rows of records for every destination and one ``all_to_all`` per
dtype delivers them: rank ``d`` ends with the global batch's ``M = W·m`` rows of its cut
(rank order, ``G`` rescaled by ``1/W`` as in :mod:`.records`), and the layer's Gram is
``K = Σ_d J_d J_dᵀ`` (one all_reduce of ``M × M`` per layer over the shard group). With
``curvature_samples`` / ``position_rows`` each rank holds its own part of the global batch's
``k`` rows (possibly none): it cuts those alike, and rank ``d`` ends with the ``k`` rows of
its cut (each source's row count from the exchanged record shapes), ``K`` being ``k × k``.
:func:`choose_fsdp_modes` picks, per layer, this or the all-gather of whole records
(``gather``) by their bytes and Gram flops.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from ..capture.norm import NORM_KINDS
from ..curvature.layer import CoveredLayer, gram_flops
from .comm import collective
from .fsdp_rows import bias_apart, cut, cut_bias, row_chunk

__all__ = ["Cut", "shard_coordinates", "exchange_rows", "choose_fsdp_modes"]

Pieces = list[tuple[str, int, int, str]]  # (layer name, site index, record index, field)
Cut = tuple[list[tuple[Tensor, Tensor]], Optional[Tensor]]  # per call (I', G'); the bias rows' gradients


def shard_coordinates(mesh: Any, dim: int) -> list[int]:
    """Each global rank's coordinate along the mesh's shard dim ``dim`` (ranks off the
    mesh: 0; they never hold rows)."""
    grid = mesh.mesh
    out = [0] * dist.get_world_size()
    for idx in torch.nonzero(grid >= 0).tolist():
        out[int(grid[tuple(idx)])] = idx[dim]
    return out


def _cut_for(lay: CoveredLayer, I: Tensor, G: Tensor, coord: int, shards: int) -> dict[str, Tensor]:
    """One record's cut for the shard ``coord``: ``I``, ``G`` (and ``b``, :func:`.fsdp_rows.cut_bias`)."""
    rows_total = lay.weight.shape[0]
    a, b = row_chunk(rows_total, shards, coord)
    out = dict(zip("IG", cut(lay.kind, lay.spec, I, G, a, b, rows_total)))
    if bias_apart(lay):
        assert lay.bias is not None
        out["b"] = cut_bias(lay.kind, G, *row_chunk(lay.bias.shape[0], shards, coord))
    return out


def exchange_rows(layers: list[CoveredLayer], coords: list[int], shards: int, rank: int,
                  count: Callable[[str, int], None],
                  held: Optional[dict[tuple[str, int, int], list[int]]] = None) -> dict[str, Cut]:
    """Per layer, this rank's cut of the global batch's records, ``[(I', G')]`` per call
    (``M`` rows, rank order; ``G'`` rescaled by ``1/W``), and a transposed layer's bias rows'
    per-sample gradients ``[M, |R'|]`` summed over the calls (alike rescaled; None: no bias
    apart); one ``all_to_all`` per dtype. ``coords``: :func:`shard_coordinates`;
    ``count(name, bytes)``: the bytes sent per layer. ``held``: per ``(layer name, site
    index, record index)`` each rank's rows, where the ranks hold different numbers of them
    (their parts of ``curvature_samples`` or ``position_rows``; None: this rank's count everywhere)."""
    world = len(coords)
    send: dict[torch.dtype, list[list[Tensor]]] = {}
    shapes: dict[torch.dtype, list[tuple[tuple[str, int, int, str], torch.Size]]] = {}
    for lay in layers:
        store = lay._info.store
        for s, site in enumerate(lay.spec.sites):
            for j, r in enumerate(store.records.get(site, [])):
                assert r.I is not None and r.G is not None
                for d in range(world):
                    for f, t in _cut_for(lay, r.I, r.G, coords[d], shards).items():
                        per_dest = send.setdefault(t.dtype, [[] for _ in range(world)])
                        per_dest[d].append(t.reshape(-1))
                        if d == rank:  # what every source sends here has this rank's cut's shapes
                            shapes.setdefault(t.dtype, []).append(((lay.name, s, j, f), t.shape))
                        else:
                            count(lay.name, t.numel() * t.element_size())
    got: dict[tuple[str, int, int, str], list[Tensor]] = {}
    for dtype, per_dest in send.items():
        flat = torch.cat([t for dest in per_dest for t in dest])
        in_splits = [sum(t.numel() for t in dest) for dest in per_dest]
        # what each source sends here: this rank's cut's shapes with the source's rows
        by_src = [[shape if held is None else torch.Size((held[key[:3]][q], *shape[1:]))
                   for key, shape in shapes[dtype]] for q in range(world)]
        sizes = [[math.prod(shape) for shape in src_shapes] for src_shapes in by_src]
        out = _all_to_all(flat, [sum(sz) for sz in sizes], in_splits)
        for src, src_shapes, sz in zip(out.split([sum(sz) for sz in sizes]), by_src, sizes):
            for (key, _), shape, part in zip(shapes[dtype], src_shapes, src.split(sz)):
                got.setdefault(key, []).append(part.view(shape))
    result: dict[str, Cut] = {}
    for lay in layers:
        parts, db = [], None
        for s, site in enumerate(lay.spec.sites):
            for j, _ in enumerate(lay._info.store.records.get(site, [])):
                I = torch.cat(got[(lay.name, s, j, "I")])
                G = torch.cat(got[(lay.name, s, j, "G")]) * (1.0 / world)
                parts.append((I, G))
                if (lay.name, s, j, "b") in got:
                    part = torch.cat(got[(lay.name, s, j, "b")]) * (1.0 / world)
                    db = part if db is None else db + part
        result[lay.name] = (parts, db)
    return result


def _all_to_all(flat: Tensor, out_splits: list[int], in_splits: list[int]) -> Tensor:
    """``flat``'s ``in_splits`` parts to the ranks in order; the ``out_splits`` parts received."""
    out = flat.new_empty(sum(out_splits))
    collective("exchange of the row shards' records",
               lambda: dist.all_to_all_single(out, flat, out_splits, in_splits))
    return out


def choose_fsdp_modes(layers: list[CoveredLayer], M: int, world: int, shards: int, bandwidth: float,
                      flop_rate: float, mode: str) -> list[str]:
    """Per layer ``"gather"`` (whole records all-gathered; every rank forms the whole Gram)
    or ``"gram-blocks"`` (:func:`exchange_rows`; the Gram summed from the row shards'),
    the faster by this rank's curvature-step time: received bytes at ``bandwidth`` plus
    Gram flops at ``flop_rate`` (the per-step work is the same in both). From shapes every
    rank shares, so every rank decides alike. ``mode``: ``"auto"``, or one for all."""
    if mode != "auto":
        return [mode] * len(layers)
    out = []
    for lay in layers:
        recs = lay.records()
        whole = sum(t.numel() * t.element_size() for r in recs for t in (r.I, r.G) if t is not None)
        frac = -(-lay.weight.shape[0] // shards) / lay.weight.shape[0]  # the largest shard's rows
        # the share of I, G a shard's cut keeps (fsdp_rows.cut), and of the Gram's g, f, o
        if lay.kind in NORM_KINDS:
            keep_i, keep_g, scale = frac, frac, (frac, 1.0, 1.0)
        elif lay.kind == "linear" and lay.spec.transposed:  # rows are input features
            keep_i, keep_g, scale = frac, 1.0, (1.0, frac, 1.0)
        elif lay.spec.transposed:  # a transposed convolution: rows are input channels (o), with groups G's cut too
            keep_i, keep_g, scale = frac, (frac if lay.spec.groups > 1 else 1.0), (1.0, 1.0, frac)
        else:
            keep_i, keep_g, scale = 1.0, frac, (1.0, 1.0, frac)
        part = whole if lay.kind == "embedding" else \
            sum((r.I.numel() * keep_i + r.G.numel() * keep_g) * r.G.element_size()
                for r in recs if r.I is not None and r.G is not None)
        g, S, f, o = lay.dims(recs)
        es = recs[0].G.element_size() if recs[0].G is not None else 4
        gather = (world - 1) * whole / bandwidth + min(gram_flops(M, g, S, f, o).values()) / flop_rate
        g_r, f_r, o_r = (max(1, round(n * sc)) for n, sc in zip((g, f, o), scale))
        blocks = ((world - 1) * part + 2.0 * (shards - 1) / shards * M * M * es) / bandwidth + \
            min(gram_flops(M, g_r, S, f_r, o_r).values()) / flop_rate
        out.append("gram-blocks" if blocks < gather else "gather")
    return out
