"""Per-rank shards of an in-memory dataset, like ``torch.utils.data.DistributedSampler``."""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

__all__ = ["shard_indices"]


def shard_indices(n: int, rank: int, world: int, epoch: int = 0, seed: int = 0,
                  shuffle: bool = True, generator: Optional[torch.Generator] = None) -> Tensor:
    """Indices (``[n // world]``, int64) of ``rank``'s shard of ``n`` samples for ``epoch``.

    One permutation of ``range(n)`` seeded by ``seed + epoch`` (the same on every rank;
    identity when ``shuffle=False``), cut to a multiple of ``world`` (the tail is dropped,
    so every rank has the same number of samples), then every ``world``-th index from
    ``rank``. The shards of one epoch are disjoint and together cover the kept indices.
    """
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"shard_indices: need 0 <= rank < world, got rank={rank}, world={world}")
    if shuffle:
        g = generator if generator is not None else torch.Generator().manual_seed(int(seed) + int(epoch))
        order = torch.randperm(n, generator=g)
    else:
        order = torch.arange(n)
    keep = (n // world) * world
    return order[:keep][rank::world]
