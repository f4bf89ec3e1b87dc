"""``torch.amp.GradScaler`` support of every optimizer here (used by the step skeleton).

A loss scaled by ``s`` scales every gradient autograd delivers — the parameter gradients
and the recorded output gradients ``G`` (hence ``P``, ``Gsum``) — by ``s``; the Gram
``K = J Jᵀ`` by ``s²``. The parameter gradients are unscaled by the scaler (or by the
optimizer, below); the records are unscaled by the optimizer, which therefore must know
the scaler: build it with ``grad_scaler=scaler`` and step with ``scaler.step(opt)``::

    scaler = torch.amp.GradScaler("cuda")
    opt = TENGraD(model, lr, damping, grad_scaler=scaler)
    with torch.autocast("cuda", torch.float16):
        loss = F.cross_entropy(model(x), y)
    opt.zero_grad()
    scaler.scale(loss).backward()  # fisher="mc": its sampled backward is scaled by s too
    scaler.unscale_(opt)           # optional (gradient clipping etc.)
    scaler.step(opt)
    scaler.update()

The optimizers set ``_step_supports_amp_scaling``: ``scaler.step(opt)`` then always calls
``opt.step()`` and hands it ``opt.grad_scale`` (the scale, or None after
``scaler.unscale_(opt)``) and ``opt.found_inf`` (device tensors; the scaler does not read
them on the host). The step then

* unscales the gradients in place by ``grad_scale`` when given (as ``unscale_`` would);
* on a statistics/curvature step (and on every step of the baselines, which read their
  flags on the host anyway) reads ``found_inf`` once: an overflow skips the step before
  anything is touched — parameters, momentum, statistics and cached factors keep their
  bits, the schedule does not advance, the next step captures again;
* on a TENGraD step that reuses curvature reads nothing: an overflow leaves a non-finite
  gradient (``found_inf`` is computed from these very gradients), which masks the update
  on the device as any non-finite step does (``tengrad_fx.optim.step.skeleton``);
* converts the records to float32 divided by the scaler's current scale (the scale of
  the backward that recorded them: ``scaler.update()`` runs after the step), once per
  capture (:meth:`~tengrad_fx.capture.store.CaptureStore.finalize`).
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor

__all__ = ["scaler_enabled", "loss_scale", "scaler_flags", "unscale_grads"]


def scaler_enabled(scaler: Any) -> bool:
    return scaler is not None and scaler.is_enabled()


def loss_scale(scaler: Any, like: Tensor) -> Optional[Tensor]:
    """The scaler's current scale as a 0-dim float32 tensor on ``like``'s device (through
    the public ``scaler.scale``: no host read), None without an enabled scaler."""
    if not scaler_enabled(scaler):
        return None
    return scaler.scale(torch.ones((), dtype=torch.float32, device=like.device))


def scaler_flags(opt: Any) -> tuple[Optional[Tensor], Optional[Tensor]]:
    """``(grad_scale, found_inf)`` handed over by ``scaler.step(opt)`` (None, None when
    stepped directly); refuses a scaler the optimizer was not built with, and a direct
    ``opt.step()`` while it was built with an enabled one."""
    found_inf = getattr(opt, "found_inf", None)
    name = type(opt).__name__
    if found_inf is not None and not scaler_enabled(opt.grad_scaler):
        raise ValueError(f"{name}: stepped by a GradScaler (scaler.step(opt)) it was not built with: pass "
                         f"grad_scaler=scaler to {name}(...); the recorded output gradients G carry the loss "
                         "scale and the optimizer must unscale them")
    if found_inf is None and scaler_enabled(opt.grad_scaler):
        raise RuntimeError(f"{name}(grad_scaler=...): step with scaler.step(opt) (after an optional "
                           "scaler.unscale_(opt)), not opt.step(): the gradients and records are scaled")
    return getattr(opt, "grad_scale", None), found_inf


def unscale_grads(grads: list[Tensor], grad_scale: Tensor) -> None:
    """``g ← g / scale`` in place (the reciprocal in float64, as ``GradScaler.unscale_``)."""
    inv = grad_scale.double().reciprocal().float()
    by_kind: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
    for g in grads:
        by_kind.setdefault((g.device, g.dtype), []).append(g)
    for (dev, _), ts in by_kind.items():
        torch._foreach_mul_(ts, inv.to(dev))
