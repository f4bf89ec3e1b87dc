"""``tools.bench --ops`` and ``--profile``: what one warmed-up optimizer step dispatches.

* :func:`ops_table`: per method and step kind (curvature / reuse), the aten ops of one
  ``opt.step()`` (all, and the kernel-launching non-view ones) and its host syncs, counted
  by ``tengrad_fx.utils.dispatch`` — the same counts on any machine (under the counters the
  damped factorization takes its device path, :data:`tengrad_fx.solve.woodbury.HOST_RETRIES`).
* :func:`profile` writes a ``torch.profiler`` Chrome trace per method (a few steps each)
  and returns the top kernels by device time (CPU time without a GPU) and the syncs.
"""
from __future__ import annotations

import os
from typing import Any, Callable

import torch

from tengrad_fx.utils.dispatch import OpCounter, SyncCounter

__all__ = ["ops_table", "profile"]


def ops_table(runners: list[Any], batch: tuple[torch.Tensor, torch.Tensor], sync: Callable[[], None],
              rounds: int = 3) -> list[dict[str, Any]]:
    """Rows ``{method, kind, ops, kernels, syncs}`` for the last counted step of each kind
    over ``rounds`` more steps of every runner (run after warm-up)."""
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    x, y = batch
    for _ in range(rounds):
        for r in runners:
            kind = "curvature" if r.is_curvature_step() else "reuse"
            counted: dict[str, Any] = {}

            def counted_step(opt_step: Callable[[], Any], counted: dict[str, Any] = counted) -> Any:
                with OpCounter() as oc, SyncCounter() as sc:
                    out = opt_step()
                counted.update(ops=oc.total, kernels=oc.kernels, syncs=sc.count)
                return out

            r.step(x, y, sync, wrap_step=counted_step)
            rows[(r.method, kind)] = {"method": r.method, "kind": kind, **counted}
    return list(rows.values())


def profile(runners: list[Any], batch: tuple[torch.Tensor, torch.Tensor], sync: Callable[[], None],
            out_dir: str, steps: int = 3, top: int = 12) -> dict[str, Any]:
    """Trace ``steps`` steps of each runner to ``out_dir/<method>.json``; per method the top
    kernels (name, calls, total ms) and the host syncs counted in ``opt.step()``."""
    from torch.profiler import ProfilerActivity, profile as tprofile

    os.makedirs(out_dir, exist_ok=True)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    x, y = batch
    res: dict[str, Any] = {}
    for r in runners:
        syncs = [0]

        def counted_step(opt_step: Callable[[], Any]) -> Any:
            with SyncCounter() as sc:
                out = opt_step()
            syncs[0] += sc.count  # noqa: B023
            return out

        with tprofile(activities=acts) as prof:
            for _ in range(steps):
                r.step(x, y, sync, wrap_step=counted_step)
        path = os.path.join(out_dir, f"{r.method}.json")
        prof.export_chrome_trace(path)
        cuda = torch.cuda.is_available()
        evs = [e for e in prof.key_averages()
               if (e.self_device_time_total if cuda else e.self_cpu_time_total) > 0]
        key = (lambda e: e.self_device_time_total) if cuda else (lambda e: e.self_cpu_time_total)
        evs.sort(key=key, reverse=True)
        res[r.method] = {"trace": path, "syncs_per_step": syncs[0] / steps,
                         "top": [(e.key, e.count // steps, key(e) / 1e3 / steps) for e in evs[:top]]}
    return res
