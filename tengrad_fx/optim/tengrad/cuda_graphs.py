"""``TENGraD(..., cuda_graph=True)``: the device part of a reuse step as a replayed CUDA graph.

A warmed-up TENGraD step reads nothing back from the device (``tests/optim/test_syncs.py``),
so its device part can be captured. :class:`StepGraphs` keeps one ``torch.cuda.CUDAGraph``
per key (the step kind and every Python number baked into it: damping, momentum, weight
decay, KL clip, whether the groups' lrs are equal, and versions that change when the
static tensors are replaced; :meth:`GraphRunner.key`):

* the first step of a key runs eagerly (warm-up), the second is captured and replayed, later
  ones replay; a warm-up that reads anything back from the device (counted by
  :class:`tengrad_fx.utils.dispatch.SyncCounter`: such a step cannot be captured) does not
  count, and after ``MAX_SYNC_WARMUPS`` of them the step runs eagerly (one warning naming
  the ops) instead of failing in the capture;
* the lr is not in the key: each group's lr is a static 0-d device tensor that is refilled
  before every run and handed to the step, so an lr schedule replays one graph;
* the inputs are static: gradients are copied into static buffers that then serve as
  ``p.grad`` (:meth:`GraphRunner.static_grads`), and a curvature step copies its stacked ``P``
  (or ``I``, ``G``) and factors into the previous ones when the shapes match;
* if capture fails, one warning, and every later step runs eagerly;
* at most ``MAX_KEYS`` keys are captured: a damping, momentum or weight decay that changes
  on every step makes every key new, so after ``MAX_KEYS`` distinct keys the step runs
  eagerly (one warning) rather than capturing a graph per step;
* when a version changes (a static tensor was replaced: a curvature step of other shapes, or
  of :class:`tengrad_fx.distributed.GlobalBatch`, whose records and factors are new on every
  curvature step) the graphs held are dropped (their memory freed; they would never replay
  again), so only the keys of the current versions count towards ``MAX_KEYS``.

Only reuse steps (no new curvature) are captured; curvature steps run eagerly. On a CPU
the same code runs, eagerly (``run`` calls the function; the static-buffer copies still
happen), so the CPU tests cover it.
"""
from __future__ import annotations

import warnings
from typing import Any, Callable, Hashable, Optional

import torch
from torch import Tensor

from ...utils.dispatch import SyncCounter
from ..step.param_groups import group_params, same_lr

__all__ = ["GraphRunner", "StepGraphs"]


class StepGraphs:
    """CUDA graphs of a step's device part, by key (module docstring)."""

    MAX_KEYS = 16
    MAX_SYNC_WARMUPS = 3

    def __init__(self) -> None:
        self.graphs: dict[Hashable, tuple[Any, Tensor]] = {}
        self.seen: set[Hashable] = set()
        self.sync_warmups: dict[Hashable, int] = {}
        self.failed = False
        self.replays = 0
        self.eager_runs = 0

    def clear(self) -> None:
        self.graphs.clear()
        self.seen.clear()

    def run(self, key: Hashable, fn: Callable[[], Tensor], device: torch.device) -> Tensor:
        if device.type != "cuda" or self.failed:
            self.eager_runs += 1
            return fn()
        hit = self.graphs.get(key)
        if hit is None:
            if key not in self.seen and len(self.seen) >= self.MAX_KEYS:
                self.failed = True
                warnings.warn(f"TENGraD(cuda_graph=True): more than {self.MAX_KEYS} step kinds (a damping, "
                              "momentum or weight decay that changes every step?); running eagerly", RuntimeWarning)
                self.eager_runs += 1
                return fn()
            if key not in self.seen:  # warm-up: eager, allocations settle
                return self._warm_up(key, fn)
            try:
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    out = fn()
            except Exception as exc:  # capture impossible here: eager from now on
                self.failed = True
                warnings.warn(f"TENGraD(cuda_graph=True): capture failed ({type(exc).__name__}: {exc}); "
                              "running eagerly", RuntimeWarning)
                self.eager_runs += 1
                return fn()
            hit = self.graphs[key] = (graph, out)
        hit[0].replay()
        self.replays += 1
        return hit[1]

    def _warm_up(self, key: Hashable, fn: Callable[[], Tensor]) -> Tensor:
        """An eager run of a new key; ``key`` is seen (captured next time) only if the run read
        nothing back from the device."""
        self.eager_runs += 1
        with SyncCounter() as sc:
            out = fn()
        if not sc.count:
            self.seen.add(key)
            return out
        n = self.sync_warmups[key] = self.sync_warmups.get(key, 0) + 1
        if n >= self.MAX_SYNC_WARMUPS:
            self.failed = True
            warnings.warn(f"TENGraD(cuda_graph=True): the step reads back from the device ({dict(sc.ops)}), "
                          "so it cannot be captured; running eagerly (pass cuda_graph=False to skip the check)",
                          RuntimeWarning)
        return out


class GraphRunner:
    """TENGraD's use of :class:`StepGraphs`: reuse steps run as a replayed graph, with
    static gradient buffers (:attr:`grads`) and static lrs (:attr:`lrs`) handed to the
    step; :attr:`version` bumps when one of them is replaced (part of the graph key)."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.graphs = StepGraphs()
        self.version = 0
        self.grads: dict[Tensor, Tensor] = {}  # param -> its static gradient buffer
        self.lrs: list[Tensor] = []  # static lr per group
        self._versions: Optional[tuple[int, int]] = None  # (version, curvature version) of the graphs held

    def clear(self) -> None:
        self.graphs.clear()

    def params(self, stats_step: bool, has_factors: bool, param_groups: list[dict[str, Any]],
               state: Any) -> Optional[list[Tensor]]:
        """The parameters with a gradient when this step runs through a graph (a reuse step
        with cached factors and every momentum buffer made), else None (eager)."""
        params = [p for p in group_params(param_groups) if p.grad is not None]
        if not self.enabled or stats_step or not has_factors or not params \
                or any(g["momentum"] and any("momentum_buffer" not in state[p] for p in g["params"]
                                             if p.grad is not None) for g in param_groups):
            return None
        return params

    def run(self, params: list[Tensor], param_groups: list[dict[str, Any]], kl_clip: Optional[float],
            curvature_version: int, fn: Callable[[list[Tensor]], Tensor]) -> Tensor:
        """``fn(lrs)`` through the graph of this step's key: static gradients, static lrs."""
        self.static_grads(params)
        lrs = self.static_lrs(param_groups, params[0])
        if (self.version, curvature_version) != self._versions:  # graphs of replaced tensors never replay again
            self.graphs.clear()
            self._versions = (self.version, curvature_version)
        key = self.key(params, param_groups, kl_clip, curvature_version)
        return self.graphs.run(key, lambda: fn(lrs), params[0].device)

    def key(self, params: list[Tensor], param_groups: list[dict[str, Any]], kl_clip: Optional[float],
            curvature_version: int) -> Hashable:
        """What a captured reuse step bakes in: every group's damping, momentum, weight decay
        and size, whether the lrs are equal (not their values), the KL clip, the static
        tensors' versions and the parameters with a gradient."""
        hyper = tuple((g["damping"], g["momentum"], g["weight_decay"], len(g["params"])) for g in param_groups)
        return ("reuse", hyper, same_lr(param_groups), kl_clip, (self.version, curvature_version),
                tuple(id(p) for p in params))

    def static_lrs(self, param_groups: list[dict[str, Any]], like: Tensor) -> list[Tensor]:
        """Each group's lr in a static 0-d float64 tensor on ``like``'s device (the Python
        float's value), refilled now: a captured graph reads the current lr."""
        if len(self.lrs) != len(param_groups) or self.lrs[0].device != like.device:
            self.lrs = [torch.zeros((), dtype=torch.float64, device=like.device) for _ in param_groups]
            self.version += 1
        for t, g in zip(self.lrs, param_groups):
            t.fill_(g["lr"])
        return self.lrs

    def static_grads(self, params: list[Tensor]) -> None:
        """Copy the gradients into static buffers that become ``p.grad`` (a captured graph
        reads fixed addresses; with ``zero_grad(set_to_none=False)`` nothing is copied)."""
        src, dst = [], []
        for p in params:
            grad = p.grad
            assert grad is not None
            buf = self.grads.get(p)
            if buf is None or buf.shape != grad.shape or buf.dtype != grad.dtype:
                buf = self.grads[p] = torch.empty_like(grad)
                self.version += 1
            if grad is not buf:
                src.append(grad)
                dst.append(buf)
                p.grad = buf
        if dst:
            torch._foreach_copy_(dst, src)
