"""The final update all optimizers share: KL clip, weight decay, heavy-ball momentum.

``d = ν·u + λw`` (``u = g`` for parameters without a preconditioned update),
``buf = μ·buf + d``, ``w ← w − lr·buf``; ``ν = min(1, sqrt(kl_clip / (lr²·Σ u·g)))``.

Everything here runs without reading the device on the host (no sync): the finiteness
flag, ``ν`` and the skip decision stay device tensors, and the masked update leaves the
parameters bit for bit unchanged when the flag is False. Each function dispatches a
fixed number of kernels whatever the number of parameters (``_foreach`` ops, one
``cat``), so a deeper model does not mean more launches here.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable, Optional

import torch
from torch import Tensor

__all__ = ["finite_flag", "all_finite", "update_dot", "kl_clip_factor", "apply_momentum_step", "selected",
           "zeroed_unless"]


def finite_flag(ts: Iterable[Tensor], extra: Optional[Tensor] = None) -> Optional[Tensor]:
    """A device ``bool`` scalar: every tensor's 2-norm is finite, and so is ``extra`` (a
    device scalar of non-negative terms, e.g. squared norms the caller has; None for no
    tensors and no ``extra``). One ``_foreach_norm`` (the fast, fused one; NaN and ±inf
    propagate into it), in at least float32, no host read: the norms are non-negative, so
    their sum is finite exactly when each is, and ``0·S == 0`` tests that in two scalar ops
    (``0·inf`` is NaN). An entry beyond ~1e19 overflows the norm, and norms summing beyond
    the dtype's range overflow the sum; both count as non-finite (such a step would not
    give a finite update anyway)."""
    ts = [t for t in ts if t.numel()]
    if not ts:
        return None if extra is None else (extra * 0) == 0
    dtype = torch.float32 if all(t.dtype in (torch.float16, torch.bfloat16, torch.float32) for t in ts) else None
    total = torch.stack(torch._foreach_norm(ts, 2, dtype=dtype)).sum()
    if extra is not None:
        total = total + extra
    return (total * 0) == 0


def all_finite(ts: list[Tensor]) -> bool:
    """True when every tensor is finite (one host read for the whole list)."""
    flag = finite_flag(ts)
    return True if flag is None else bool(flag)


def update_dot(updates: dict[Tensor, Tensor], local: Callable[[Tensor], Tensor] = lambda t: t) -> Tensor:
    """``Σ u·g`` over ``{param: u}`` (a device scalar; one pass over ``u`` and ``g``);
    ``local(p.grad)``: the gradient's part ``u`` is of (a shard's; the whole one by default)."""
    us = list(updates.values())
    prods = torch._foreach_mul(us, [local(p.grad).to(u.dtype) for p, u in updates.items()])  # type: ignore[arg-type, misc]
    return torch.cat([t.reshape(-1) for t in prods]).sum()


def kl_clip_factor(updates: dict[Tensor, Tensor], lr: float | Tensor, kl_clip: Optional[float],
                   ug: Optional[Tensor] = None) -> Optional[Tensor]:
    """``ν`` of the KL clip over the preconditioned parameters as a device scalar, 1 where
    ``Σ u·g ≤ 0`` (NaN where it is NaN: such a step is skipped by its finiteness flag);
    None when the clip is off. ``ug``: ``Σ u·g`` when the
    caller already has it (else one pass over ``u`` and ``g`` here)."""
    if kl_clip is None or not updates:
        return None
    if ug is None:
        ug = update_dot(updates)
    # 1/ν = max(1, sqrt(lr²·max(Σ u·g, 0) / kl_clip)): ν = 1 where Σ u·g ≤ 0
    coef = lr * lr / kl_clip  # a float64 device scalar for a static lr: rounded once, like a Python float
    if isinstance(coef, Tensor):
        coef = coef.to(ug.dtype)
    return (ug.clamp(min=0.0) * coef).sqrt().clamp(min=1.0).reciprocal()


def zeroed_unless(ds: list[Tensor], ok: Tensor) -> list[Tensor]:
    """``ds`` with every entry zeroed where ``ok`` is False (a select, so NaN/inf go too):
    one ``cat`` + one ``where`` per dtype."""
    return selected(ok, ds, None)


def selected(ok: Tensor, when: list[Tensor], otherwise: Optional[list[Tensor]]) -> list[Tensor]:
    """``when[i]`` where the device bool ``ok`` holds, else ``otherwise[i]`` (None: zeros), as
    views of one flat tensor per dtype: one ``cat`` per list + one ``where`` per dtype, no
    host read. ``otherwise[i]`` has ``when[i]``'s shape and dtype."""
    out: list[Optional[Tensor]] = [None] * len(when)
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, d in enumerate(when):
        by_dtype.setdefault(d.dtype, []).append(i)
    for idx in by_dtype.values():
        flat = torch.cat([when[i].reshape(-1) for i in idx])
        other = torch.zeros((), dtype=flat.dtype, device=flat.device) if otherwise is None \
            else torch.cat([otherwise[i].reshape(-1) for i in idx])
        flat = torch.where(ok, flat, other)
        for i, part in zip(idx, flat.split([when[i].numel() for i in idx])):
            out[i] = part.view(when[i].shape)
    return out  # type: ignore[return-value]


FUSED_DEVICES = ("cpu", "cuda")
"""Devices whose ``aten::_fused_sgd_`` kernel takes the update (:func:`_fused_momentum_step`)."""


def _fusable(ps: list[Tensor], ds: list[Tensor], state: dict[Any, Any], momentum: float,
             lr: float | Tensor) -> bool:
    """Can :func:`_fused_momentum_step` apply this step? Its kernel walks each tensor's
    storage in order, so parameter, update and buffer must all be contiguous (a
    channels-last parameter takes the ``_foreach`` path), of one dtype, on a fused device.
    The CUDA kernel reads a tensor ``lr`` as float32: a float64 parameter would step with
    an lr rounded to float32 (2e-8 relative), so float64 with a CUDA tensor lr is not fused."""
    if isinstance(lr, Tensor) and lr.is_cuda and any(p.dtype == torch.float64 for p in ps):
        return False
    for p, d in zip(ps, ds):
        if p.device.type not in FUSED_DEVICES or not p.is_floating_point() or d.dtype != p.dtype \
                or d.device != p.device or not (p.is_contiguous() and d.is_contiguous()):
            return False
        buf = state[p].get("momentum_buffer") if momentum else None
        if buf is not None and (buf.dtype != p.dtype or not buf.is_contiguous()):
            return False
    return True


def _fused_momentum_step(state: dict[Any, Any], ps: list[Tensor], ds: list[Tensor], lr: float | Tensor, momentum: float,
                         weight_decay: float, ok: Optional[Tensor], inv_nu: Optional[Tensor] = None,
                         scaled: frozenset[int] = frozenset()) -> None:
    """The update by ``aten::_fused_sgd_`` (the kernel of ``torch.optim.SGD(fused=True)``),
    one call per (device, dtype, first step, scaled) bucket: ``d = u + λw``, ``buf = μ·buf + d``
    (``buf = d`` on a first step), ``w ← w − lr·buf``. ``found_inf = 1[not ok]`` makes the
    kernel return before touching anything: the parameters and buffers keep their bits,
    decided on the device (no host read). The ``scaled`` entries of ``ds`` are divided by
    ``inv_nu`` (float32 ``1/ν``, the kernel's ``grad_scale``) inside the same pass, which
    writes ``ν·u`` back into them; the other entries are not written."""
    found_inf = None if ok is None else torch.logical_not(ok).to(torch.float32)
    buckets: dict[tuple[Any, ...], tuple[list[Tensor], list[Tensor], list[Tensor]]] = {}
    for i, (p, d) in enumerate(zip(ps, ds)):
        first = False
        if momentum:
            st = state[p]
            first = "momentum_buffer" not in st
            if first:
                st["momentum_buffer"] = torch.empty_like(p, memory_format=torch.contiguous_format)
        b = buckets.setdefault((p.device, p.dtype, first, i in scaled), ([], [], []))
        b[0].append(p)
        b[1].append(d)
        if momentum:
            b[2].append(state[p]["momentum_buffer"])
    if isinstance(lr, Tensor) and lr.is_cuda:  # the CUDA kernel reads a tensor lr as float32 (float64: not fused)
        lr = lr.to(torch.float32)
    for (device, _, first, sc), (bp, bd, bb) in buckets.items():
        torch._fused_sgd_(bp, bd, bb, weight_decay=weight_decay, momentum=momentum, lr=lr, dampening=0.0,
                          nesterov=False, maximize=False, is_first_step=first,
                          grad_scale=inv_nu.to(device) if sc and inv_nu is not None else None,
                          found_inf=found_inf.to(device) if found_inf is not None else None)


def _shares_grad(p: Tensor, d: Tensor) -> bool:
    """Does ``d`` live in ``p.grad``'s storage (writing it would write the gradient)?"""
    g = p.grad
    return g is not None and d.untyped_storage().data_ptr() == g.untyped_storage().data_ptr()


@torch.no_grad()
def apply_momentum_step(state: dict[Any, Any], params: list[Tensor], updates: dict[Tensor, Tensor],
                        lr: float | Tensor, momentum: float, weight_decay: float, nu: Optional[Tensor] = None,
                        ok: Optional[Tensor] = None) -> Optional[bool]:
    """Apply the step to every parameter with a gradient; momentum buffers
    live in ``state[p]["momentum_buffer"]`` as in ``torch.optim.SGD``.

    A parameter's ``.grad`` is never written. ``updates`` are not written either, except
    on the fused path with ``ν`` and float32 updates that do not share a gradient's storage:
    there the kernel scales them in place to ``ν·u`` (they are the step's temporaries; one
    pass fewer than a separate ``ν·u``).

    ``ok`` (device bool scalar, or None = apply): when it is False the parameters and the
    momentum buffers keep their exact bits. Masked form, with ``o = 1[ok]``::

        a = (−o·d) + 0.0            # +0.0 when skipped (never −0.0), else −d
        buf ← buf·(o ? μ : 1) − a    # buf − (+0.0) leaves every bit of buf
        b = (o·lr)·buf + 0.0        # +0.0 when skipped
        w ← w − b

    On CPU and CUDA with contiguous tensors all of this is aten's fused SGD kernel
    (:func:`_fused_momentum_step`: one pass, the skip read on the device); elsewhere
    ``_foreach`` ops in the masked form above.

    ``lr`` may be a 0-d device tensor (a CUDA graph's static lr, refilled before each replay).

    Momentum buffers are created on a parameter's first update (``buf = d``, as SGD);
    while one is missing the flag is read on the host once (warm-up, a sync), so a
    skipped first step creates no buffer. Returns False if that read found a skip
    (nothing was changed), True if it found none, None when nothing was read.
    """
    ps = [p for p in params if p.grad is not None]
    if not ps:
        return None
    ds: list[Tensor] = [updates[p] if p in updates else p.grad for p in ps]  # type: ignore[misc]  # ps: grads set
    read: Optional[bool] = None
    if ok is not None and momentum and any("momentum_buffer" not in state[p] for p in ps):
        read = bool(ok)  # warm-up only: buffers are created from a taken step
        if not read:
            return False
        ok = None
    fused = _fusable(ps, ds, state, momentum, lr)
    pre = [i for i, p in enumerate(ps) if p in updates] if nu is not None else []
    if fused and pre and all(ds[i].dtype == torch.float32 and not _shares_grad(ps[i], ds[i]) for i in pre):
        # ν inside the kernel: grad_scale = 1/ν (float32 only), the updates overwritten with ν·u
        _fused_momentum_step(state, ps, ds, lr, momentum, weight_decay, ok,
                             nu.to(torch.float32).reciprocal(), frozenset(pre))  # type: ignore[union-attr]
        return read
    if pre:  # ν·u for the preconditioned updates (new tensors: updates stay as given)
        for i, d in zip(pre, torch._foreach_mul([ds[i] for i in pre], nu)):  # type: ignore[arg-type]
            ds[i] = d
    if fused:
        _fused_momentum_step(state, ps, ds, lr, momentum, weight_decay, ok)
    else:
        _foreach_momentum_step(state, ps, ds, lr, momentum, weight_decay, ok)
    return read


def _foreach_momentum_step(state: dict[Any, Any], ps: list[Tensor], ds: list[Tensor], lr: float | Tensor,
                           momentum: float, weight_decay: float, ok: Optional[Tensor]) -> None:
    """The update by ``_foreach`` ops in the masked form of :func:`apply_momentum_step`
    (``ds``: the parameters' ``ν·u`` or ``g``; not written)."""
    if ok is not None:
        ds = zeroed_unless(ds, ok)
    if isinstance(lr, Tensor):
        lr = lr.to(ds[0].dtype)
    if weight_decay:
        ds = torch._foreach_add(ds, ps, alpha=weight_decay)  # type: ignore[assignment]
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
            if ok is None:
                torch._foreach_mul_(old_bufs, momentum)
                torch._foreach_add_(old_bufs, old_ds)
            else:
                o = ok.to(old_bufs[0].dtype)
                a = torch._foreach_mul(old_ds, -o)
                torch._foreach_add_(a, 0.0)
                mu = torch.full((), momentum, dtype=o.dtype, device=o.device)
                torch._foreach_mul_(old_bufs, torch.where(ok, mu, torch.ones_like(mu)))
                torch._foreach_sub_(old_bufs, a)
        ds = bufs
    if ok is None:
        if isinstance(lr, Tensor):
            torch._foreach_sub_(ps, torch._foreach_mul(ds, lr))
        else:
            torch._foreach_add_(ps, ds, alpha=-lr)
    else:
        b = torch._foreach_mul(ds, ok.to(ds[0].dtype) * lr)
        torch._foreach_add_(b, 0.0)
        torch._foreach_sub_(ps, b)
