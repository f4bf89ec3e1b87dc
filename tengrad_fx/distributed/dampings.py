"""The relative-damping scales of the ``gram-blocks`` layers, agreed on every rank.

Every rank forms a ``gram-blocks`` layer's ``u = (g − Jᵀc)/α`` (:mod:`.gram_blocks`), so
every rank needs the ``α`` that the layer's solver factorized ``K + MαI`` with. The param
groups give ``α`` on every rank; with ``relative_damping`` it is scaled by ``s = tr(K)/M²``
of the global Gram (:func:`~tengrad_fx.optim.tengrad.cache.relative_scales`), which only
the solver holds. So once per curvature step each owner broadcasts its layers' ``s``
(float64, one value per layer, one bucket per owner; a replicated layer's every rank has),
and every rank forms ``α·s`` by :func:`~tengrad_fx.optim.tengrad.cache.layer_alphas`,
the one function the solver's factorization takes its ``α`` from: the same bits. A damping changed on a
reuse step needs nothing sent (the solver refactorizes with the new ``α·s``, every rank
forms the same).
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from ..optim.tengrad.cache import CurvatureCache
from .comm import Bucket, broadcast_buckets, pack, unpack
from .records import REPLICATED
from .traffic import broadcast_sent

__all__ = ["share_scales"]


def share_scales(cache: CurvatureCache, owner: dict[str, int], modes: dict[str, str], rank: int,
                 device: torch.device, count: Callable[[str, int], None]) -> dict[str, Tensor]:
    """Layer name -> its damping scale ``s`` (a float64 scalar) for every ``gram-blocks``
    layer, on every rank; empty where the cache scales no damping (every rank alike).
    ``owner``/``modes``: as of this curvature step (the same on every rank); ``count``:
    ``count(layer name, bytes)`` for the bytes this rank sends."""
    if not cache.relative:
        return {}
    blocks = [name for name in owner if modes.get(name) == "gram-blocks"]
    held = {lay.name: s for lay, s in zip(cache.layers(), cache.scales if cache.scales is not None else [])
            if lay.name in blocks}
    buckets: dict[int, Bucket] = {}
    for name in blocks:
        if owner[name] != REPLICATED:
            buckets.setdefault(owner[name], Bucket(owner[name], torch.float64, device)).add(name, torch.Size([]))
            if owner[name] == rank:
                count(name, int(broadcast_sent(8)))
    blist = list(buckets.values())
    flats = [pack([held[name] for name in b.keys], b) if b.rank == rank
             else torch.empty(b.numel, dtype=torch.float64, device=device) for b in blist]
    broadcast_buckets(flats, blist, "relative damping scales (gram-blocks)")
    for flat, b in zip(flats, blist):
        held.update(zip(b.keys, unpack(flat, b)))
    return held
