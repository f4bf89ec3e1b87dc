"""The step's shaping of TENGraD's updates: graft, momentum before the polar factor, polar factor.

On the natural-gradient updates ``u`` (``(F + αI)⁻¹ g`` per layer, every parameter shape),
in this order (:class:`UpdateShaping`):

1. ``graft``: every parameter that keeps its own update gets the step length of SGD or
   RMSProp (:func:`.graft.graft_updates`; the polar factor discards a norm, so the
   orthogonalized weights skip it).
2. ``orthogonalize_momentum`` (Muon's order): each orthogonalized weight keeps its
   momentum *before* the polar factor, with its param group's ``μ``, Nesterov as Muon::

       b' = μ·b + u,    v = u + μ·b'          (b: state[p]["polar_momentum"], zeros at first)

   and ``v`` goes on to the polar factor. Those weights then take no momentum after it
   (:meth:`UpdateShaping.momentum_parts`): ``w ← w − lr·(ν·polar(v) + λw)``. ``b'`` is
   stored only once the step's flag is known (:meth:`UpdateShaping.commit`): a skipped step
   keeps every bit of ``b``. Without the option the momentum is the step's heavy ball on
   the polar factors (``buf = μ·buf + polar(u)``).
3. ``orthogonalize``: each ≥ 2-D weight's update (or ``v``) replaced by its polar factor
   at an RMS of 0.2 (:func:`.graft.orthogonalize_updates`).

Everything runs on the device with no host read (a CUDA graph captures it).
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor

from ..step.result import StepResult
from ..step.update import selected
from .graft import (GRAFT_BETA2, GRAFT_EPS, check_graft, check_group_orthogonalize, check_orthogonalize,
                    graft_updates, orthogonalize_updates, orthogonalized)

__all__ = ["POLAR_MOMENTUM", "UpdateShaping"]

POLAR_MOMENTUM = "polar_momentum"  # the state key of the momentum kept before the polar factor


class UpdateShaping:
    """``graft``, ``orthogonalize`` and ``orthogonalize_momentum`` of one optimizer (module docstring).

    Args:
        graft: None, ``"sgd"`` or ``"rmsprop"``.
        orthogonalize: False, True, ``"eigh"`` or ``"newton-schulz"``.
        orthogonalize_momentum: the momentum before the polar factor (needs ``orthogonalize``).
        groups: the optimizer's param groups (their ``"orthogonalize"`` flags are checked).
    """

    def __init__(self, graft: Optional[str], orthogonalize: Any, orthogonalize_momentum: bool,
                 groups: list[dict[str, Any]]):
        check_graft(graft, GRAFT_BETA2, GRAFT_EPS)
        self.graft = graft
        self.orthogonalize: Optional[str] = check_orthogonalize(orthogonalize)
        check_group_orthogonalize(groups, self.orthogonalize)
        if not isinstance(orthogonalize_momentum, bool):
            raise ValueError(f"orthogonalize_momentum must be True or False, got {orthogonalize_momentum!r}")
        if orthogonalize_momentum and not self.orthogonalize:
            raise ValueError("orthogonalize_momentum=True takes the polar factor of the momentum: it needs "
                             "orthogonalize='newton-schulz' or 'eigh' (orthogonalize is off)")
        self.momentum_first = orthogonalize_momentum
        self._polar: set[Tensor] = set()  # the weights orthogonalized by the last shaped step
        self._pending: list[tuple[Tensor, Tensor]] = []  # (b, b') to store once the flag is known

    def shape(self, result: StepResult, groups: list[dict[str, Any]], params: list[Tensor],
              state: Any) -> StepResult:
        """``result`` with its updates grafted, momentum-ed and orthogonalized as configured;
        ``params``: every parameter in a group (the graft's candidates)."""
        updates, self._pending = result.updates, []  # a skip raised before the last commit drops its b'
        polar = {p for g in groups if g.get("orthogonalize", True) for p in g["params"]
                 if orthogonalized(p, updates)} if self.orthogonalize else set()
        self._polar = polar
        if self.graft is not None:
            kept = [p for p in params if p not in polar]
            updates = {**updates, **self._graft(updates, kept, state)}
        if polar and self.orthogonalize:
            if self.momentum_first:
                updates = {**updates, **self._nesterov(updates, polar, groups, state)}
            updates = self._orthogonalize(updates, [p for p in params if p in polar])
        if updates is result.updates:
            return result
        return StepResult(updates, result.ok, None, result.grad_sq)

    def _graft(self, updates: dict[Tensor, Tensor], kept: list[Tensor], state: Any) -> dict[Tensor, Tensor]:
        """The grafted updates of ``kept`` (:func:`.graft.graft_updates`)."""
        assert self.graft is not None
        return graft_updates(updates, kept, state, self.graft, GRAFT_BETA2, GRAFT_EPS)

    def _orthogonalize(self, updates: dict[Tensor, Tensor], polar: list[Tensor]) -> dict[Tensor, Tensor]:
        """``updates`` with the weights ``polar`` (in the param groups' order) orthogonalized
        (:func:`.graft.orthogonalize_updates`)."""
        assert self.orthogonalize
        return orthogonalize_updates(updates, self.orthogonalize, only=set(polar))

    def _nesterov(self, updates: dict[Tensor, Tensor], polar: set[Tensor], groups: list[dict[str, Any]],
                  state: Any) -> dict[Tensor, Tensor]:
        """``{p: v = u + μ·b'}`` with ``b' = μ·b + u`` for the weights in ``polar``, by
        ``_foreach`` ops per group; the ``(b, b')`` pairs wait for :meth:`commit`."""
        out: dict[Tensor, Tensor] = {}
        for g in groups:
            ps = [p for p in g["params"] if p in polar]
            if not ps:
                continue
            mu = float(g["momentum"])
            us = [updates[p] for p in ps]
            bufs = [state[p].setdefault(POLAR_MOMENTUM, torch.zeros_like(u)) for p, u in zip(ps, us)]
            new = torch._foreach_mul(bufs, mu)
            torch._foreach_add_(new, us)
            out.update(zip(ps, torch._foreach_add(us, new, alpha=mu)))
            self._pending.extend(zip(bufs, new))
        return out

    def momentum_parts(self, group: dict[str, Any]) -> list[tuple[list[Tensor], float]]:
        """``[(params, μ)]`` of ``group`` for the step's momentum: weights whose momentum came
        before the polar factor take ``μ = 0`` there."""
        if not self.momentum_first or not self._polar:
            return [(group["params"], group["momentum"])]
        first = [p for p in group["params"] if p in self._polar]
        rest = [p for p in group["params"] if p not in self._polar]
        return [(ps, mu) for ps, mu in ((rest, group["momentum"]), (first, 0.0)) if ps]

    def commit(self, ok: Optional[Tensor]) -> None:
        """Store the pending ``b'`` where the step's flag ``ok`` (a device bool; None: taken)
        holds, else keep ``b`` bit for bit: one ``where`` over all of them, no host read."""
        pending, self._pending = self._pending, []
        if not pending:
            return
        bufs, new = [b for b, _ in pending], [n for _, n in pending]
        torch._foreach_copy_(bufs, new if ok is None else selected(ok, new, bufs))
