"""Step-by-step checks of TENGraD over several batches (curvature and reuse steps).

* :func:`check_steps_against_dense`: each step's update equals ``solve(JᵀJ/m + αI, g)`` per
  covered layer (:func:`testing.oracle.dense_layer_updates`), ``J`` at the last curvature
  step's parameters and batch (for the MC Fisher with the labels ``mc_capture`` sampled,
  drawn again from the same seed), ``g`` the current gradient.
* :func:`step_counts`: kernels, all aten ops and host syncs of warmed-up steps by kind.
"""
from __future__ import annotations

import copy
from typing import Any, Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from .oracle import dense_layer_updates
from .tengrad_step import mc_labels

__all__ = ["check_steps_against_dense", "float64_batches", "step_counts"]

Batch = tuple[torch.Tensor, torch.Tensor]


def float64_batches(shape: tuple[int, ...], classes: int, sizes: tuple[int, ...] = (8, 5, 8),
                    seed: int = 5) -> list[Batch]:
    """Random float64 inputs ``[m, *shape]`` and labels, one batch per size in ``sizes``
    (default: curvature, a smaller reuse batch, curvature with ``curvature_every=2``)."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(m, *shape, generator=g, dtype=torch.float64), torch.randint(0, classes, (m,), generator=g))
            for m in sizes]


def _grad(ref: nn.Module, x: torch.Tensor, y: torch.Tensor,
          extra: Optional[Callable[[nn.Module], torch.Tensor]]) -> dict[str, torch.Tensor]:
    ref.zero_grad()
    loss = F.cross_entropy(ref(x), y)
    (loss + extra(ref) if extra is not None else loss).backward()
    return {n: p.grad.detach().clone() for n, p in ref.named_parameters()}


def check_steps_against_dense(model: nn.Module, template: nn.Module, opt: Any, batches: list[Batch],
                              damping: float, fisher: str, covered: dict[str, str],
                              extra_loss: Optional[Callable[[nn.Module], torch.Tensor]] = None,
                              after_step: Optional[Callable[[int, torch.Tensor], None]] = None,
                              tol: float = 1e-8) -> list[bool]:
    """Run ``opt`` (``lr=1``, no momentum, ``kl_clip=None``) over ``batches`` of the
    prepared ``model`` (cross-entropy, plus ``extra_loss(model)`` — a term outside ``J``);
    every parameter's change must equal the dense ``u`` on ``template`` (the unprepared
    model, loaded with the current parameters) to ``tol``. ``after_step(t, x)`` runs after
    step ``t``. Returns which steps were curvature steps."""
    J_at = None
    kinds = []
    for t, (x, y) in enumerate(batches):
        ref = copy.deepcopy(template)
        ref.load_state_dict(model.state_dict())
        curvature = opt._is_curvature_step()
        kinds.append(curvature)
        opt.zero_grad()
        out = model(x)
        opt.seed_mc(100 + t)
        opt.mc_capture(out)
        loss = F.cross_entropy(out, y)
        (loss + extra_loss(model) if extra_loss is not None else loss).backward()
        if curvature or J_at is None:
            yJ = y
            if fisher == "mc":  # the labels mc_capture sampled, drawn again from the same seed
                yJ = mc_labels(out, 100 + t)
                assert not torch.equal(yJ, y)
            J_at = (ref, x, yJ)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        opt.step()
        u = dense_layer_updates(*J_at, F.cross_entropy, _grad(ref, x, y, extra_loss), damping, covered)
        for n, u_ref in u.items():
            got = before[n] - model.get_parameter(n).detach()
            err = ((got - u_ref).norm() / u_ref.norm()).item()
            assert err <= tol, (t, n, err)
        if after_step is not None:
            after_step(t, x)
    return kinds


def step_counts(model: nn.Module, opt: Any, x: torch.Tensor, y: torch.Tensor,
                steps: int = 4) -> dict[str, tuple[int, int, int]]:
    """``{step kind: (kernels, all aten ops, host syncs)}`` of the last of ``steps`` steps of
    each kind (``"curvature"``/``"reuse"``) on the batch ``x, y`` (``tengrad_fx.utils.dispatch``)."""
    from tengrad_fx.utils.dispatch import OpCounter, SyncCounter

    out: dict[str, tuple[int, int, int]] = {}
    for _ in range(steps):
        kind = "curvature" if opt._is_curvature_step() else "reuse"
        opt.zero_grad()
        o = model(x)
        opt.mc_capture(o)
        F.cross_entropy(o, y).backward()
        with OpCounter() as oc, SyncCounter() as sc:
            opt.step()
        out[kind] = (oc.kernels, oc.total, sc.count)
    return out
