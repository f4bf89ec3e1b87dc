"""``tools.bench --capture``: what capture costs in forward + backward, interleaved.

    python -m tools.bench --capture [--model tiny] [--m 32] [--steps 20] [--warmup 3]

Rows (each its own copy of the same initial model, the same batches, one forward +
backward of the cross-entropy per round, the order rotated every round):

* ``plain``: the unprepared model (the baseline of ``x plain``);
* ``capture off``: the prepared model with ``capturing(model, False)``;
* ``capture on``: the prepared model recording ``(I, G)`` of every covered layer (the
  eager path, :mod:`tengrad_fx.capture.eager`);
* ``capture on, custom ops``: the same through the ``tengrad_fx::*`` custom ops (the
  path ``torch.compile`` takes; every call before the eager path existed);
* ``linconv on`` / ``linconv on, custom ops``: prepared with ``only_linear_conv=True``
  (norm layers and added parameters left out), capture on.

A second table times one forward + backward of a one-layer model per capture kind on a
tiny input (launch-bound: the capture mechanism's per-call cost), the minimum over 7
repeats of the mean of ``--steps`` calls (robust to a loaded machine): capture off, on, and on
through the custom ops, and the two overheads over capture off in µs per layer call.

No optimizer step: the rows differ only in the capture mechanism (no ``P`` is
materialized; that is curvature work, timed by the ordinary bench rows). Printed: median
times, ``x plain`` = the median over rounds of the row's forward + backward over
``plain``'s in the same round (robust to a loaded machine), and the ``tengrad_fx::*`` ops
and the aten ops one forward + backward dispatches (counted by a dispatch mode:
machine-independent).
"""
from __future__ import annotations

import argparse
import copy
import statistics
import time
import timeit
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

import tengrad_fx
from tengrad_fx.capture import eager
from tools.dispatch import OpCounter

__all__ = ["run_capture", "report_capture", "per_call", "ROWS"]

ROWS = ("plain", "capture off", "capture on", "capture on, custom ops", "linconv on", "linconv on, custom ops")


class _Row:
    """One row's model and how it runs a forward + backward."""

    def __init__(self, name: str, base: nn.Module, example: torch.Tensor):
        self.name = name
        model = copy.deepcopy(base)
        if name != "plain":
            kw = {"only_linear_conv": True} if name.startswith("linconv") else {}
            model = tengrad_fx.prepare(model, example_inputs=(example[:2],), **kw)
            tengrad_fx.capturing(model, name != "capture off")
        self.model = model
        self.custom_ops = name.endswith("custom ops")
        self.times: list[tuple[float, float]] = []

    def step(self, x: torch.Tensor, y: torch.Tensor, sync: Callable[[], None]) -> None:
        was, eager.FORCE_CUSTOM_OPS = eager.FORCE_CUSTOM_OPS, self.custom_ops
        try:
            for p in self.model.parameters():
                p.grad = None
            sync()
            t0 = time.perf_counter()
            loss = F.cross_entropy(self.model(x), y)
            sync()
            t1 = time.perf_counter()
            loss.backward()
            sync()
            self.times.append((t1 - t0, time.perf_counter() - t1))
        finally:
            eager.FORCE_CUSTOM_OPS = was

    def ops(self, x: torch.Tensor, y: torch.Tensor) -> tuple[int, int]:
        """``(tengrad_fx ops, aten ops)`` of one forward + backward."""
        with OpCounter() as oc:
            self.step(x, y, lambda: None)
        self.times.pop()
        n_capture = sum(n for op, n in oc.ops.items() if op.startswith("tengrad_fx."))
        return n_capture, oc.total - n_capture


def run_capture(base: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]], steps: int, warmup: int,
                sync: Callable[[], None]) -> dict[str, dict[str, float]]:
    """Median forward / backward seconds per row (and the dispatched op counts)."""
    rows = [_Row(name, base, batches[0][0]) for name in ROWS]
    for r in range(warmup + steps):
        x, y = batches[r % len(batches)]
        for i in range(len(rows)):
            rows[(i + r) % len(rows)].step(x, y, sync)
    out = {}
    plain = [sum(t) for t in rows[0].times[warmup:]]
    for row in rows:
        times = row.times[warmup:]
        fwd, bwd = statistics.median(t[0] for t in times), statistics.median(t[1] for t in times)
        total = statistics.median(t[0] + t[1] for t in times)
        ratio = statistics.median(sum(t) / p for t, p in zip(times, plain))
        n_capture, n_aten = row.ops(*batches[0])
        out[row.name] = {"forward": fwd, "backward": bwd, "total": total, "ratio": ratio,
                         "tengrad_ops": n_capture, "aten_ops": n_aten}
    return out


def report_capture(res: dict[str, dict[str, float]], head: str) -> None:
    """Print the table: ms, ratio to ``plain``, ops per forward + backward."""
    print(head)
    print(f"{'row':<26}{'fwd+bwd ms':>11}{'forward ms':>11}{'backward ms':>12}{'x plain':>9}"
          f"{'tengrad_fx ops':>15}{'aten ops':>9}")
    for name, r in res.items():
        print(f"{name:<26}{r['total'] * 1e3:>11.2f}{r['forward'] * 1e3:>11.2f}{r['backward'] * 1e3:>12.2f}"
              f"{r['ratio']:>9.3f}{r['tengrad_ops']:>15d}{r['aten_ops']:>9d}")


def _one_layer(kind: str) -> tuple[nn.Module, torch.Tensor]:
    """A one-layer model of ``kind`` and a batch of 4 tiny inputs."""
    g = torch.Generator().manual_seed(0)
    img, vec = torch.randn(4, 4, 6, 6, generator=g), torch.randn(4, 16, generator=g)
    return {
        "linear": (nn.Linear(16, 16), vec),
        "conv2d": (nn.Conv2d(4, 4, 3, padding=1), img),
        "batchnorm2d": (nn.BatchNorm2d(4), img),
        "layernorm": (nn.LayerNorm(16), vec),
        "groupnorm": (nn.GroupNorm(2, 4), img),
        "rmsnorm": (nn.RMSNorm(16), vec),
        "embedding": (nn.Embedding(10, 16), torch.randint(0, 10, (4, 3), generator=g)),
    }[kind]


def per_call(repeat: int = 7, number: int = 50) -> dict[str, dict[str, float]]:
    """Per capture kind: seconds of one forward + backward with capture off / on / on
    through the custom ops (min over ``repeat`` of the mean of ``number`` calls)."""
    out = {}
    for kind in ("linear", "conv2d", "batchnorm2d", "layernorm", "groupnorm", "rmsnorm", "embedding"):
        layer, x = _one_layer(kind)
        model = tengrad_fx.prepare(nn.Sequential(layer), example_inputs=(x[:2],))
        if x.is_floating_point():
            x = x.requires_grad_()
        res = {}
        for name, capture, force in (("off", False, False), ("on", True, False), ("custom ops", True, True)):
            tengrad_fx.capturing(model, capture)
            was, eager.FORCE_CUSTOM_OPS = eager.FORCE_CUSTOM_OPS, force
            try:
                def call() -> None:
                    model(x).sum().backward()
                for _ in range(5):
                    call()
                res[name] = min(timeit.repeat(call, number=number, repeat=repeat)) / number
            finally:
                eager.FORCE_CUSTOM_OPS = was
        out[kind] = res
    return out


def report_per_call(res: dict[str, dict[str, float]]) -> None:
    print("\none layer, forward + backward, µs per call (min over repeats; input of 4 samples)")
    print(f"{'kind':<14}{'off':>9}{'on':>9}{'custom ops':>12}{'on - off':>10}{'custom - off':>14}")
    for kind, r in res.items():
        print(f"{kind:<14}{r['off'] * 1e6:>9.1f}{r['on'] * 1e6:>9.1f}{r['custom ops'] * 1e6:>12.1f}"
              f"{(r['on'] - r['off']) * 1e6:>10.1f}{(r['custom ops'] - r['off']) * 1e6:>14.1f}")


def main_capture(args: argparse.Namespace, base: nn.Module, batches: list[Any], sync: Callable[[], None]) -> dict:
    """``tools.bench --capture``: run, print, return the results."""
    res = run_capture(base, batches, args.steps, args.warmup, sync)
    report_capture(res, f"model={args.model} m={args.m} device={args.device} threads={torch.get_num_threads()} "
                        f"torch={torch.__version__}: forward + backward, median of {args.steps} interleaved "
                        f"rounds after {args.warmup} warm-up")
    calls = per_call(number=max(2, args.steps))
    report_per_call(calls)
    return {"rows": res, "per_call": calls}
