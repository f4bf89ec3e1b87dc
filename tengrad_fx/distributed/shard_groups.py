"""A layer's row shards as a layer group, so FSDP2's step runs the one Woodbury apply
(:func:`tengrad_fx.optim.tengrad.layer_groups.precondition`).

:class:`ShardRows` is one layer (``L = 1``) whose ``J g`` and ``Jᵀ c`` are this rank's
rows' (:mod:`.fsdp_rows`): ``J_r g_r`` is a partial sum the apply sums over the shard
group (:meth:`.fsdp.FSDPShards.sum_parts`), ``J_rᵀ c`` is this rank's rows of the
layer's ``Jᵀ c``; gradients and updates are the local shards, flattened to
``[1, n_r]`` (``n_r``: the shard's entries; zero on a rank that holds no rows).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional

import torch
from torch import Tensor

from ..optim.tengrad.layer_groups import LayerGroup
from .fsdp_rows import Rows, local

__all__ = ["ShardRows"]


@dataclass(eq=False)
class ShardRows(LayerGroup):
    """One layer's rows on this rank (module docstring); ``rows``: its records cut to them."""

    form: ClassVar[str] = "shard-rows"
    rows: Optional[Rows] = None

    def grads(self) -> tuple[Tensor, Optional[Tensor]]:
        """``(gw [1, n_w], gb [1, n_b] or None)``: the local gradient shards (zeros where missing)."""
        def one(p: Tensor) -> Tensor:
            return (local(p.grad) if p.grad is not None else torch.zeros_like(local(p))).reshape(1, -1)
        w, b = self.param_pairs()[0]
        return one(w), (one(b) if b is not None else None)

    def jvp(self, gw: Tensor, gb: Optional[Tensor]) -> Tensor:
        """``J_r g_r``, ``[1, M]`` (this rank's part of ``J g``)."""
        assert self.rows is not None, "ShardRows: no rows"
        w, b = self.param_pairs()[0]
        gb_r = gb[0].view(local(b).shape) if gb is not None and b is not None else None
        return self.rows.jvp(gw[0].view(local(w).shape), gb_r).unsqueeze(0)

    def vjp(self, c: Tensor) -> tuple[Tensor, Optional[Tensor]]:
        """This rank's rows of ``Jᵀ c`` for ``c [1, M]``: ``(w [1, n_w], b [1, n_b] or None)``."""
        assert self.rows is not None, "ShardRows: no rows"
        JTw, JTb = self.rows.vjp(c[0])
        return JTw.reshape(1, -1), (JTb.reshape(1, -1) if JTb is not None else None)

    def split(self, uw: Tensor, ub: Optional[Tensor]) -> dict[Tensor, Tensor]:
        """``{param: u}`` keyed by the DTensor parameter, ``u`` its local shard's rows."""
        out: dict[Tensor, Tensor] = {}
        for p, u in zip(self.param_pairs()[0], (uw, ub)):
            if p is not None and p.grad is not None and u is not None:
                out[p] = u[0].view(local(p).shape).to(p.dtype)
        return out
