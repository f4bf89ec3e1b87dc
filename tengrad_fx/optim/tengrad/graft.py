"""Grafting: TENGraD's direction with a first-order method's step length, per parameter.

For every parameter tensor ``p`` with a gradient ``g`` (Distributed Shampoo's grafting)::

    u_p ← u_p · ‖a_p‖ / ‖u_p‖          (u_p = 0 stays 0)

where ``u_p`` is the natural-gradient update ((F + αI)⁻¹ g of its layer, restricted to
``p``) and ``a_p`` the grafted method's direction:

* ``"sgd"``: ``a = g``: the step is as long as SGD's at the same lr;
* ``"rmsprop"``: ``a = g / (√v̂ + ε)``, ``v ← β₂ v + (1 − β₂) g²``, ``v̂ = v / (1 − β₂ᵗ)``
  (Adam's second moment; the heavy-ball momentum that follows plays Adam's first moment);
  a step with a non-finite gradient (which the optimizer skips) leaves every ``v`` and ``t``.

Parameters without a preconditioned update (no curvature record) get ``u = a``. Runs on
the device without a host read; ``v`` and the count ``t`` live in the optimizer's
per-parameter state (``"graft_sq"``, ``"graft_t"``).

Orthogonalizing (:func:`orthogonalize_updates`, after any grafting of the other
parameters: a polar factor discards a grafted norm, so the weights it replaces skip the
graft and keep no RMSProp moment): each ≥ 2-D weight's
update, as a matrix ``U [out, in·k…]``, is replaced by its orthogonal polar factor
(:func:`tengrad_fx.solve.polar_factor`, Muon's direction taken from TENGraD's update
instead of the momentum) times ``0.2·√max(out, in·k…)``, which gives it an RMS of 0.2 per
entry, about AdamW's (Moonlight's scaling), so one Adam-sized lr serves the weights and
the (grafted or raw) biases. ``"eigh"`` (``orthogonalize=True``) computes the polar factor
exactly, with an eigendecomposition per weight that on CUDA reads its status on the host (no
CUDA graph); ``"newton-schulz"`` takes Muon's five quintic Newton–Schulz steps instead
(:func:`tengrad_fx.solve.newton_schulz_polar`: singular values in about [0.7, 1.2], matmuls
only, no host read, capturable).
"""
from __future__ import annotations

import math
from typing import Any, Callable, Optional, Sequence

import torch
from torch import Tensor

from ... import solve
from ..step.checks import check_choice
from ..step.update import finite_flag, zeroed_unless

__all__ = ["GRAFTS", "GRAFT_SQ", "GRAFT_T", "GRAFT_BETA2", "GRAFT_EPS", "ORTHO_RMS", "POLAR_METHODS", "check_graft",
           "check_group_orthogonalize", "check_orthogonalize", "graft_updates", "orthogonalize_updates",
           "orthogonalized"]

GRAFTS = ("sgd", "rmsprop")
GRAFT_SQ, GRAFT_T = "graft_sq", "graft_t"  # the state keys of RMSProp's v and t
GRAFT_BETA2, GRAFT_EPS = 0.999, 1e-8  # Adam's
ORTHO_RMS = 0.2  # per-entry RMS of an orthogonalized update (Moonlight's match to AdamW)
POLAR_METHODS = ("eigh", "newton-schulz")


def _grad(p: Tensor) -> Optional[Tensor]:
    return p.grad


def check_graft(graft: Optional[str], beta2: float, eps: float) -> None:
    """Raise ``ValueError`` for an unknown ``graft`` or ``graft_beta2 ∉ [0, 1)``, ``graft_eps ≤ 0``."""
    if graft is None:
        return
    check_choice("graft", graft, GRAFTS)
    if not 0.0 <= beta2 < 1.0:
        raise ValueError(f"graft_beta2 must be in [0, 1), got {beta2!r}")
    if not eps > 0:
        raise ValueError(f"graft_eps must be > 0, got {eps!r}")


def _rmsprop_directions(grads: list[Tensor], state: Any, params: list[Tensor], beta2: float,
                        eps: float, ok: Optional[Tensor] = None) -> list[Tensor]:
    """``g / (√v̂ + ε)`` per parameter, updating ``v`` and ``t`` in ``state[p]``; a step with
    a non-finite gradient (which the optimizer skips) leaves every ``v`` and ``t``. ``ok``:
    whether the gradients are finite (a device bool; None: read from ``grads``). A fixed
    number of ``_foreach`` launches, whatever the number of parameters."""
    for p, g in zip(params, grads):
        st = state[p]
        if GRAFT_SQ not in st:
            st[GRAFT_SQ] = torch.zeros_like(g)
            st[GRAFT_T] = torch.zeros((), dtype=g.dtype, device=g.device)
    vs = [state[p][GRAFT_SQ] for p in params]
    ts = [state[p][GRAFT_T] for p in params]
    if ok is None:
        ok = finite_flag(grads)
    if ok is None:  # only empty gradients
        ok = torch.ones((), dtype=torch.bool, device=grads[0].device)
    safe = zeroed_unless(grads, ok)  # zero where the step is skipped: v·1 + 0 keeps v's bits
    okf = ok.to(vs[0].dtype)
    torch._foreach_add_(ts, [okf] * len(ts))  # a list: the 0-d Tensor overload reads it on the host
    torch._foreach_mul_(vs, torch.where(ok, beta2, 1.0).to(vs[0].dtype))
    torch._foreach_addcmul_(vs, safe, safe, value=1 - beta2)
    bias = torch._foreach_pow(beta2, ts)  # β₂ᵗ
    torch._foreach_neg_(bias)
    torch._foreach_add_(bias, 1.0)  # 1 − β₂ᵗ (> 0 once v has a term: t ≥ 1)
    denom = torch._foreach_div(vs, bias)
    torch._foreach_sqrt_(denom)
    torch._foreach_add_(denom, eps)
    return list(torch._foreach_div(grads, denom))


def graft_updates(updates: dict[Tensor, Tensor], params: list[Tensor], state: Any, graft: str,
                  beta2: float = 0.999, eps: float = 1e-8, *, grad: Callable[[Tensor], Optional[Tensor]] = _grad,
                  norms: Callable[[list[Tensor]], Sequence[Tensor]] = torch._foreach_norm,
                  ok: Optional[Tensor] = None) -> dict[Tensor, Tensor]:
    """``{param: u}`` for every parameter of ``params`` with a gradient: ``updates``' ``u``
    (same shape as the parameter) rescaled to the norm of the ``graft`` direction, and that
    direction itself where ``updates`` has none (module docstring).

    ``grad(p)``: ``p``'s gradient as ``updates`` holds ``u`` (default ``p.grad``); ``norms``:
    the norms of a list of tensors, the directions' then the updates' in one call (default
    ``torch._foreach_norm``); ``ok``: whether the gradients are finite, for RMSProp's
    moments (None: read from them). A sharded step passes local shards, norms summed over
    the shards, and the flag all ranks agree on (:mod:`tengrad_fx.distributed.fsdp_shaping`)."""
    ps = [p for p in params if grad(p) is not None]
    grads: list[Tensor] = [grad(p) for p in ps]  # type: ignore[misc]
    if not ps:
        return {}
    dirs = list(grads) if graft == "sgd" else _rmsprop_directions(grads, state, ps, beta2, eps, ok)
    pre = [i for i, p in enumerate(ps) if p in updates]
    out = {p: d for p, d in zip(ps, dirs)}
    if pre:
        us = [updates[ps[i]] for i in pre]
        both = list(norms([dirs[i] for i in pre] + us))
        a_norm, u_norm = both[:len(pre)], both[len(pre):]
        tiny = torch.finfo(us[0].dtype).tiny
        torch._foreach_clamp_min_(u_norm, tiny)
        scale = torch._foreach_div(a_norm, u_norm)
        for i, u in zip(pre, torch._foreach_mul(us, scale)):
            out[ps[i]] = u
    return out


def orthogonalized(p: Tensor, updates: dict[Tensor, Tensor]) -> bool:
    """Does :func:`orthogonalize_updates` replace ``p``'s update (a ≥ 2-D parameter with one)?"""
    return p.ndim >= 2 and p in updates


def check_orthogonalize(value: Any) -> Optional[str]:
    """``orthogonalize`` as a method name: False/None → None, True → ``"eigh"``, or one of
    :data:`POLAR_METHODS`; anything else is a ValueError naming the argument."""
    if value is None or value is False:
        return None
    if value is True:
        return "eigh"
    if value not in POLAR_METHODS:
        raise ValueError(f"orthogonalize must be False, True (= 'eigh'), 'eigh' or 'newton-schulz', got {value!r}")
    return str(value)


def check_group_orthogonalize(groups: list[dict[str, Any]], method: Optional[str] | bool) -> None:
    """A param group's ``"orthogonalize"`` is a bool (its weights take the optimizer's polar
    factor or not); ``True`` needs ``orthogonalize=`` on the optimizer (the method)."""
    for i, g in enumerate(groups):
        value = g.get("orthogonalize", None)
        if value is None:
            continue
        if not isinstance(value, bool):
            raise ValueError(f"param_groups[{i}]['orthogonalize'] must be True or False (the method is the "
                             f"optimizer's orthogonalize=), got {value!r}")
        if value and not method:
            raise ValueError(f"param_groups[{i}]['orthogonalize'] is True but the optimizer has orthogonalize=False; "
                             "pass orthogonalize=True, 'eigh' or 'newton-schulz' to TENGraD")


def orthogonalize_updates(updates: dict[Tensor, Tensor], method: str = "eigh",
                          only: Optional[set[Tensor]] = None) -> dict[Tensor, Tensor]:
    """``updates`` with every ≥ 2-D parameter's ``u`` (viewed ``[shape[0], -1]``; those in
    ``only`` where given) replaced by ``ORTHO_RMS·√max(rows, cols)·polar(u)``, ``polar`` by
    ``method`` (:data:`POLAR_METHODS`); other entries as they are (module docstring).
    ``"newton-schulz"`` takes the weights of one matrix shape (and dtype, device) as one
    batch: its launches grow with the number of distinct shapes, not of weights."""
    out = dict(updates)
    groups: dict[tuple[Any, ...], list[Tensor]] = {}
    for p, u in updates.items():
        if orthogonalized(p, updates) and (only is None or p in only):
            groups.setdefault((u.shape[0], math.prod(u.shape[1:]), u.dtype, u.device), []).append(p)
    for (rows, cols, _, _), ps in groups.items():
        scale = ORTHO_RMS * max(rows, cols) ** 0.5
        if method == "eigh":
            for p in ps:
                out[p] = solve.polar_factor(updates[p].reshape(rows, cols), scale=scale).reshape(p.shape)
            continue
        mats = [updates[p].reshape(rows, cols) for p in ps]
        q = solve.newton_schulz_polar(mats[0] if len(ps) == 1 else torch.stack(mats), scale=scale)
        for p, qp in zip(ps, [q] if len(ps) == 1 else q.unbind(0)):
            out[p] = qp.reshape(p.shape)
    return out
