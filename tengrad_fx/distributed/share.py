"""Step 5 of :class:`~.optimizer.DistributedTENGraD`: every rank gets every layer's ``u``
(owners broadcast theirs, bucketed per ``(owner, dtype)``), or with ``mode="local"`` the
ranks' ``u`` are averaged; the bytes each layer sends are counted in ``comm_bytes``."""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor

from ..curvature.layer import CoveredLayer
from .comm import Bucket, all_sum, pack, start_broadcasts, unpack, wait_all
from .records import REPLICATED
from .traffic import all_reduce_sent, broadcast_sent

__all__ = ["UpdateSharing"]


class UpdateSharing:
    """Step 5 of :class:`~.global_batch.GlobalBatch` on this rank (``rank`` of ``world``):
    the ``u`` broadcasts in flight and the bytes each layer sent on the current step
    (:attr:`comm_bytes`). ``layers``: every covered layer, graph order; ``owner``: layer
    name -> owning rank or ``REPLICATED``; ``mode``: layer name -> ``"gather"`` / ``"gram-blocks"``."""

    def __init__(self, rank: int, world: int):
        self.rank, self.world = rank, world
        self.comm_bytes: dict[str, int] = {}
        self._pending: Optional[tuple[list[Tensor], list[Bucket], list[Any]]] = None
        self._names: dict[int, str] = {}

    def reset(self, layers: list[CoveredLayer]) -> None:
        """A new step: nothing in flight, nothing sent yet."""
        self.comm_bytes, self._pending = {}, None
        self._names = {id(p): lay.name for lay in layers for p in (lay.weight, lay.bias) if p is not None}

    def start(self, layers: list[CoveredLayer], owner: dict[str, int], mode: dict[str, str],
              local: dict[Tensor, Tensor]) -> None:
        """Step 5, started: each owner's ``u`` of its gather layers, one bucketed async
        ``broadcast`` per ``(owner, dtype)`` (the same buckets in the same order on every rank)."""
        buckets: dict[tuple[int, torch.dtype], Bucket] = {}
        for lay in layers:
            if lay.name not in owner or owner[lay.name] == REPLICATED or mode.get(lay.name) == "gram-blocks":
                continue  # every rank has its u
            for p in _params(lay):
                key = (owner[lay.name], p.dtype)
                if key not in buckets:
                    buckets[key] = Bucket(key[0], p.dtype, p.device)
                buckets[key].add(p, p.shape)
        blist = list(buckets.values())
        flats = []
        for b in blist:
            if b.rank == self.rank:
                flats.append(pack([local.get(p, p.grad) for p in b.keys], b))
            else:
                flats.append(torch.empty(b.numel, dtype=b.dtype, device=b.device))
            for p in b.keys:
                self.add_param_bytes(p, int(broadcast_sent(p.numel() * p.element_size())))
        self._pending = (flats, blist, start_broadcasts(flats, blist))

    def finish(self, layers: list[CoveredLayer], owner: dict[str, int], mode: dict[str, str],
               local: dict[Tensor, Tensor]) -> dict[Tensor, Tensor]:
        """Step 5, finished: every rank has every owned layer's ``u`` (graph order)."""
        if self._pending is None:
            self.start(layers, owner, mode, local)
        assert self._pending is not None
        flats, blist, works = self._pending
        self._pending = None
        wait_all(works)
        got: dict[Tensor, Tensor] = {}
        for flat, b in zip(flats, blist):
            got.update(zip(b.keys, unpack(flat, b)))
        order = [lay for lay in layers if lay.name in owner]
        return {p: (got[p] if p in got else local[p]) for lay in order for p in _params(lay)
                if p in got or p in local}

    def average(self, layers: list[CoveredLayer], local: dict[Tensor, Tensor]) -> dict[Tensor, Tensor]:
        """``mode="local"``: the mean over ranks of every covered parameter's ``u`` (one
        ``all_reduce`` per dtype; a parameter without a local ``u`` contributes ``g``)."""
        params = [p for lay in layers if lay.captured for p in _params(lay)]
        buckets: dict[torch.dtype, Bucket] = {}
        for p in params:
            buckets.setdefault(p.dtype, Bucket(REPLICATED, p.dtype, p.device)).add(p, p.shape)
        out: dict[Tensor, Tensor] = {}
        for b in buckets.values():
            flat = pack([local.get(p, p.grad) for p in b.keys], b)
            all_sum(flat)
            flat.div_(self.world)
            out.update(zip(b.keys, unpack(flat, b)))
            for p in b.keys:
                self.add_param_bytes(p, int(all_reduce_sent(p.numel() * p.element_size(), self.world)))
        return {p: out[p] for p in params}

    def add_bytes(self, name: str, nbytes: int) -> None:
        self.comm_bytes[name] = self.comm_bytes.get(name, 0) + nbytes

    def add_param_bytes(self, p: Tensor, nbytes: int) -> None:
        """``nbytes`` sent for the parameter ``p``, counted under its layer's name."""
        self.add_bytes(self._names.get(id(p), "?"), nbytes)


def _params(lay: CoveredLayer) -> list[Tensor]:
    return [p for p in (lay.weight, lay.bias) if p is not None and p.grad is not None]
