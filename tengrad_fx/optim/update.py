"""The final update all optimizers share: KL clip, weight decay, heavy-ball momentum.

``d = ν·u + λw`` (``u = g`` for parameters without a preconditioned update),
``buf = μ·buf + d``, ``w ← w − lr·buf``; ``ν = min(1, sqrt(kl_clip / (lr²·Σ u·g)))``.
"""
from __future__ import annotations

import math
from typing import Any, Optional

import torch
from torch import Tensor

__all__ = ["all_finite", "kl_clip_factor", "apply_momentum_step"]


def all_finite(ts: list[Tensor]) -> bool:
    """True when every tensor is finite (one host sync for the whole list)."""
    if not ts:
        return True
    return bool(torch.stack([torch.isfinite(t).all() for t in ts]).all())


def kl_clip_factor(updates: dict[Tensor, Tensor], lr: float, kl_clip: Optional[float]) -> float:
    """``ν`` of the KL clip over the preconditioned parameters (1 when off or ``Σ u·g ≤ 0``)."""
    if kl_clip is None or not updates:
        return 1.0
    vg = float(sum((u * p.grad).sum() for p, u in updates.items())) * lr ** 2
    return min(1.0, math.sqrt(kl_clip / vg)) if vg > 0 else 1.0


@torch.no_grad()
def apply_momentum_step(state: dict[Any, Any], params: list[Tensor], updates: dict[Tensor, Tensor],
                        lr: float, momentum: float, weight_decay: float, nu: float = 1.0) -> None:
    """Apply the step to every parameter with a gradient (foreach kernels); momentum buffers
    live in ``state[p]["momentum_buffer"]`` as in ``torch.optim.SGD``."""
    ps = [p for p in params if p.grad is not None]
    ds = [updates[p] if p in updates else p.grad for p in ps]
    if nu != 1.0:
        ds = [d * nu if p in updates else d for p, d in zip(ps, ds)]
    if weight_decay:
        ds = torch._foreach_add(ds, ps, alpha=weight_decay)
    if momentum:
        bufs, old_bufs, old_ds = [], [], []
        for p, d in zip(ps, ds):
            st = state[p]
            if "momentum_buffer" not in st:
                st["momentum_buffer"] = torch.clone(d).detach()
            else:
                old_bufs.append(st["momentum_buffer"])
                old_ds.append(d)
            bufs.append(st["momentum_buffer"])
        if old_bufs:
            torch._foreach_mul_(old_bufs, momentum)
            torch._foreach_add_(old_bufs, old_ds)
        ds = bufs
    if ps:
        torch._foreach_add_(ps, ds, alpha=-lr)
