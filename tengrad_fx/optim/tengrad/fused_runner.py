"""``TENGraD(compile=True)``: curvature steps by :func:`~tengrad_fx.optim.tengrad.fused_update.fused_update`.

:class:`FusedStep` gathers every covered layer's record in the fused function's input form
(materialized ``P [m, n]`` or a single-position Linear's ``I [m, f]``, ``G [m, o]``; a
transposed Linear's ``J`` in its weight's layout), runs it
under ``torch.compile`` (eager, with one warning, if compilation fails) and splits the flat
per-layer updates back into ``{param: u}``.

Only curvature steps take this path: the compiled function recomputes the Gram and its
Cholesky from the records, which is the work of a curvature step. A reuse step (no new
curvature) runs the modular path (:mod:`tengrad_fx.optim.tengrad.layer_groups`): its first one
builds the groups and factors from the same records, the following ones only apply
``J g`` / ``Jᵀ c``. So ``compile=True`` never turns a reuse step into a curvature step.
"""
from __future__ import annotations

import warnings
from typing import Any, Callable, Optional

import torch
from torch import Tensor

from ..._compile import own_code
from ... import solve
from ..step.result import StepResult
from .fused_update import LayerInput, fused_update
from .jacobian_sites import marked_jacobian_sites

__all__ = ["FusedStep", "fused_curvature_step"]

Used = list[tuple[list[torch.nn.Parameter], int]]


class FusedStep:
    """The compiled fused update of a curvature step (module docstring).

    Args:
        backend: the ``torch.compile`` backend (e.g. ``"inductor"``, or a callable), or None
            for eager. Each instance compiles its own copy of :func:`fused_update` (one
            optimizer's shapes never evict another's compiled code).
    """

    def __init__(self, backend: Optional[Any]):
        self.fn: Optional[Callable[..., Any]] = None
        if backend is not None:
            self.fn = torch.compile(own_code(fused_update), dynamic=False, fullgraph=True, backend=backend)

    @staticmethod
    def inputs(layers: list[Any]) -> Optional[tuple[list[LayerInput], Used]]:
        """Layer inputs of :func:`fused_update` and ``(params, m)`` per used layer, or None
        if a layer has no fused form (several records, or a conv/sequence by factors)."""
        ins: list[LayerInput] = []
        used: Used = []
        for layer in layers:
            params = [p for p in (layer.weight, layer.bias) if p is not None]
            if not all(p.requires_grad and p.grad is not None for p in params) or not layer.captured:
                continue
            recs = layer.records()
            if len(recs) != 1:
                return None
            r, k = recs[0], layer._scale()
            if r.P is not None:
                Jb = r.Gsum * k if layer.bias is not None else r.P.new_zeros(r.m, 0)
                ins.append(("J", r.P * k, Jb))
            elif layer.kind == "linear" and r.I is not None and r.I.dim() == 2:
                if layer.spec.transposed:  # weight [d_in, d_out]: J in the parameter's layout
                    Jw, Jb = layer.per_sample_grads()
                    ins.append(("J", Jw.flatten(1), Jb if Jb is not None else Jw.new_zeros(r.m, 0)))
                else:
                    ins.append(("IG", r.I, r.G * k, layer.bias is not None))
            else:
                return None
            used.append((params, r.m))
        return ins, used

    def __call__(self, layers: list[Any], push_through: bool, damping: float, loss_reduction: str,
                 solve_dtype: Optional[torch.dtype]) -> Optional[tuple[dict[Tensor, Tensor], Tensor, Used]]:
        """``({param: u}, ok, used)`` with ``ok`` a device bool (every Cholesky succeeded;
        a failed one skips the step on the device), or None for the modular path."""
        prep = self.inputs(layers)
        if prep is None or not prep[0]:
            return None
        ins, used = prep
        m = used[0][1]
        if any(cm != m for _, cm in used):
            return None
        scale = solve.push_through_scale(m, loss_reduction)
        grads = [torch.cat([p.grad.flatten() for p in params if p.grad is not None]) for params, _ in used]
        args = (ins, grads, m * damping, scale, damping, push_through, solve_dtype)
        try:
            us, ok = (self.fn or fused_update)(*args)
        except Exception as exc:  # compilation failure: eager from now on
            warnings.warn(f"TENGraD(compile=True): torch.compile failed ({type(exc).__name__}: {exc}); "
                          "running the fused update eagerly", RuntimeWarning)
            self.fn = None
            us, ok = fused_update(*args)
        out: dict[Tensor, Tensor] = {}
        for (params, _), u in zip(used, us):
            off = 0
            for p in params:
                out[p] = u[off: off + p.numel()].view_as(p).to(p.dtype)
                off += p.numel()
        return out, ok.all(), used


def fused_curvature_step(opt: Any, push_through: bool, damping: Any) -> Optional[StepResult]:
    """A curvature step of the TENGraD ``opt`` by its fused update (``compile``; its
    :class:`FusedStep` ``opt._fused``), None where that does not apply (a distribution whose
    solve is not one process's, ``SingleProcess.fuses``; per-group or relative dampings, a
    metric, position rows, or a layer without a fused form: the modular path). The cache
    then holds no groups or factors (``CurvatureCache.set_fused``)."""
    if not opt.compile or not opt.distribution.fuses or isinstance(damping, tuple) or opt.curvature.relative \
            or opt.metric is not None or opt.position_rows is not None:
        return None
    fused = opt._fused(opt._layers, push_through, damping, opt._info.loss_reduction, opt.solve_dtype)
    if fused is None:
        return None
    updates, flag, used = fused
    opt.curvature.set_fused(bool(used))
    store = opt._info.store  # keep the store's materialization choice as the modular path would
    store.jacobian_sites = marked_jacobian_sites(opt._layers, opt.strategy, opt.jacobian_budget,
                                                 store.jacobian_sites)
    return StepResult(updates, flag)
