"""``TENGraD(..., cuda_graph=True)``: the device part of a reuse step as a replayed CUDA graph.

A warmed-up TENGraD step reads nothing back from the device (``tests/optim/test_syncs.py``),
so its device part can be captured. :class:`StepGraphs` keeps one ``torch.cuda.CUDAGraph``
per key (the step kind and every Python number baked into it: lr, damping, momentum,
weight decay, KL clip, and a version that changes when the static tensors are replaced):

* the first step of a key runs eagerly (warm-up), the second is captured and replayed, later
  ones replay;
* the inputs are static: gradients are copied into static buffers that then serve as
  ``p.grad`` (``TENGraD._static_grads``), and a curvature step copies its stacked ``P``
  (or ``I``, ``G``) and factors into the previous ones when the shapes match;
* if capture fails, one warning, and every later step runs eagerly;
* at most ``MAX_KEYS`` keys are captured: an lr schedule that changes the lr on every
  step makes every key new, so after ``MAX_KEYS`` distinct keys the step runs eagerly
  (one warning) rather than capturing a graph per step.

Only reuse steps (no new curvature) are captured; curvature steps run eagerly. On a CPU
the same code runs, eagerly (``run`` calls the function; the static-buffer copies still
happen), so the CPU tests cover it.
"""
from __future__ import annotations

import warnings
from typing import Any, Callable, Hashable

import torch
from torch import Tensor

__all__ = ["StepGraphs"]


class StepGraphs:
    """CUDA graphs of a step's device part, by key (module docstring)."""

    MAX_KEYS = 16

    def __init__(self) -> None:
        self.graphs: dict[Hashable, tuple[Any, Tensor]] = {}
        self.seen: set[Hashable] = set()
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
                warnings.warn(f"TENGraD(cuda_graph=True): more than {self.MAX_KEYS} step kinds (an lr or "
                              "damping that changes every step?); running eagerly", RuntimeWarning)
                self.eager_runs += 1
                return fn()
            if key not in self.seen:  # warm-up: eager, allocations settle
                self.seen.add(key)
                self.eager_runs += 1
                return fn()
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
