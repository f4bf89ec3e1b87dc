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

__all__ = ["UpdateSharing"]


class UpdateSharing:
    """Mixin of :class:`~.optimizer.DistributedTENGraD` (reads ``_all_layers``, ``_owner``,
    ``_mode``, ``rank``, ``world``; keeps ``_sharing`` and ``comm_bytes``)."""

    _all_layers: list[CoveredLayer]
    _owner: dict[str, int]
    _mode: dict[str, str]
    _sharing: Optional[tuple[Any, Any, Any]]
    comm_bytes: dict[str, int]
    rank: int
    world: int

    def _start_share(self, local: dict[Tensor, Tensor]) -> None:
        """Step 5, started: each owner's ``u`` of its gather layers, one bucketed async
        ``broadcast`` per ``(owner, dtype)`` (the same buckets in the same order on every rank)."""
        buckets: dict[tuple[int, torch.dtype], Bucket] = {}
        for lay in self._all_layers:
            if lay.name not in self._owner or self._owner[lay.name] == REPLICATED \
                    or self._mode.get(lay.name) == "gram-blocks":
                continue  # every rank has its u
            for p in self._params(lay):
                key = (self._owner[lay.name], p.dtype)
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
            for p in b.keys:  # a pipelined broadcast: every rank sends each u once
                self._add_bytes(self._name_of(p), p.numel() * p.element_size())
        self._sharing = (flats, blist, start_broadcasts(flats, blist))

    def _share_updates(self, local: dict[Tensor, Tensor]) -> dict[Tensor, Tensor]:
        """Step 5, finished: every rank has every owned layer's ``u`` (graph order)."""
        if self._sharing is None:
            self._start_share(local)
        assert self._sharing is not None
        flats, blist, works = self._sharing
        self._sharing = None
        wait_all(works)
        got: dict[Tensor, Tensor] = {}
        for flat, b in zip(flats, blist):
            got.update(zip(b.keys, unpack(flat, b)))
        order = [lay for lay in self._all_layers if lay.name in self._owner]
        return {p: (got[p] if p in got else local[p]) for lay in order for p in self._params(lay)
                if p in got or p in local}

    def _average_updates(self, local: dict[Tensor, Tensor]) -> dict[Tensor, Tensor]:
        """``mode="local"``: the mean over ranks of every covered parameter's ``u`` (one
        ``all_reduce`` per dtype; a parameter without a local ``u`` contributes ``g``)."""
        params = [p for lay in self._all_layers if lay.captured for p in self._params(lay)]
        buckets: dict[torch.dtype, Bucket] = {}
        for p in params:
            buckets.setdefault(p.dtype, Bucket(REPLICATED, p.dtype, p.device)).add(p, p.shape)
        out: dict[Tensor, Tensor] = {}
        for b in buckets.values():
            flat = pack([local.get(p, p.grad) for p in b.keys], b)
            all_sum(flat)
            flat.div_(self.world)
            out.update(zip(b.keys, unpack(flat, b)))
            for p in b.keys:  # ring all-reduce
                self._add_bytes(self._name_of(p), int(2 * (self.world - 1) / self.world * p.numel() * p.element_size()))
        return {p: out[p] for p in params}

    def _add_bytes(self, name: str, nbytes: int) -> None:
        self.comm_bytes[name] = self.comm_bytes.get(name, 0) + nbytes

    @staticmethod
    def _params(lay: CoveredLayer) -> list[Tensor]:
        return [p for p in (lay.weight, lay.bias) if p is not None and p.grad is not None]

    def _name_of(self, p: Tensor) -> str:
        for lay in self._all_layers:
            if p is lay.weight or p is lay.bias:
                return lay.name
        return "?"
