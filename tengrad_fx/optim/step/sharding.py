"""Where the shared step's tensors live: the primitives :class:`~.skeleton.StepSkeleton`'s
masked update is written against, so one step serves whole parameters and shards of them.

:class:`Sharding` is one process holding whole parameters (every primitive the identity,
the momentum step :func:`.update.apply_momentum_step` itself); a strategy whose ranks hold
shards of each parameter (FSDP2: :class:`tengrad_fx.distributed.FSDPShards`) overrides
them: ``local`` gives a rank's shard, ``sum_shards`` sums a partial sum over the shard
group, ``agree`` ANDs the step's flag over every rank, ``wrap_state`` keeps a new state
tensor as a sharded tensor of its parameter, and :meth:`Sharding.momentum_step` runs on
the local shards (:func:`shard_momentum_step`).
"""
from __future__ import annotations

from typing import Any, Optional

from torch import Tensor

from .update import apply_momentum_step

__all__ = ["Sharding", "WHOLE", "shard_momentum_step"]


class Sharding:
    """The step's primitives for whole parameters in one process (module docstring).

    Attributes:
        checks_loss_scale: the first empirical curvature step compares the gradients with
            the captured ``I, G`` to catch a loss summed where a mean was declared
            (:mod:`.reduction_check`; it reads whole weights and gradients).
    """

    checks_loss_scale = True

    def local(self, t: Tensor) -> Tensor:
        """The part of ``t`` (a parameter, its gradient or state) this process writes: ``t``."""
        return t

    def sum_shards(self, t: Tensor, what: str) -> Tensor:
        """``t`` (a partial sum over this process's part of the parameters) summed over the
        parts, in place, and returned; ``what`` names it in a collective's error. Here: ``t``."""
        return t

    def sum_parts(self, ts: list[Tensor], what: str) -> list[Tensor]:
        """:meth:`sum_shards` of several partial sums at once (one collective where there
        is one): ``ts`` itself here."""
        return ts

    def agree(self, ok: Tensor) -> Tensor:
        """The step's device flag as every process applies it (here: ``ok``)."""
        return ok

    def wrap_state(self, p: Tensor, t: Tensor) -> Tensor:
        """A new state tensor ``t`` of ``p`` (of :meth:`local` ``(p)``'s shape) as kept in the
        optimizer's state: ``t`` itself here."""
        return t

    def momentum_step(self, state: dict[Any, Any], params: list[Tensor], updates: dict[Tensor, Tensor],
                      lr: float | Tensor, momentum: float, weight_decay: float, nu: Optional[Tensor],
                      ok: Optional[Tensor]) -> Optional[bool]:
        """The momentum step of ``params`` (one momentum): :func:`.update.apply_momentum_step`."""
        return apply_momentum_step(state, params, updates, lr, momentum, weight_decay, nu, ok)


WHOLE = Sharding()
"""Whole parameters in one process (the baselines' and single-process TENGraD's step)."""


def shard_momentum_step(sharding: Sharding, state: dict[Any, Any], params: list[Tensor],
                        updates: dict[Tensor, Tensor], lr: float | Tensor, momentum: float, weight_decay: float,
                        nu: Optional[Tensor], ok: Optional[Tensor]) -> Optional[bool]:
    """:func:`.update.apply_momentum_step` on the local shards of ``params`` (``updates``
    are local already): the same kernels on each shard, its ``.grad`` set to the local
    gradient for the kernel's reading, then cleared; a new momentum buffer is kept as
    ``sharding.wrap_state(p, buf)``."""
    ps = [p for p in params if p.grad is not None]
    shards = [sharding.local(p.detach()) for p in ps]
    views: dict[Tensor, dict[str, Tensor]] = {}
    ups: dict[Tensor, Tensor] = {}
    for p, s in zip(ps, shards):
        assert p.grad is not None
        s.grad = sharding.local(p.grad)
        buf = state[p].get("momentum_buffer")
        views[s] = {} if buf is None else {"momentum_buffer": sharding.local(buf)}
        if p in updates:
            ups[s] = updates[p]
    try:
        read = apply_momentum_step(views, shards, ups, lr, momentum, weight_decay, nu, ok)
    finally:
        for s in shards:
            s.grad = None
    for p, s in zip(ps, shards):
        if "momentum_buffer" in views[s] and "momentum_buffer" not in state[p]:
            state[p]["momentum_buffer"] = sharding.wrap_state(p, views[s]["momentum_buffer"])
    return read
