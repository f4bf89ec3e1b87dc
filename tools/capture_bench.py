"""``tools.bench --capture``: what capture costs in forward + backward, interleaved.

    python -m tools.bench --capture [--model tiny] [--m 32] [--steps 20] [--warmup 3]
    python -m tools.capture_bench [--depth 50] [--rounds 15] [--number 20] [--device cpu]  # table 3 only

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

A third table is the launch-bound regime of a GPU step, seen on any machine: a deep narrow
model (``--depth`` × Conv2d(4, 4, 1) + BatchNorm2d(4) + ReLU, then a Linear; 2 samples of
2×2; one CPU thread) whose kernels cost next to nothing, so what the prepared model adds
per covered layer call is host time: µs per covered call over the plain model, capture
off and on, forward and forward + backward (:func:`launch_bound`; the minimum over
interleaved rounds of each row's time, minus the plain model's: a loaded machine only adds;
on CPU the time is the thread's CPU time, which other processes' load does not inflate).

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
from tengrad_fx.utils.dispatch import OpCounter

__all__ = ["run_capture", "report_capture", "per_call", "launch_bound", "report_launch_bound", "ROWS"]

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
                    model(x).sum().backward()  # noqa: B023
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


def _deep_narrow(depth: int) -> nn.Module:
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Conv2d(4, 4, 1), nn.BatchNorm2d(4), nn.ReLU()]
    return nn.Sequential(*layers, nn.Flatten(), nn.Linear(16, 3))


def launch_bound(depth: int = 50, rounds: int = 15, number: int = 20, device: str = "cpu",
                 sync: Callable[[], None] = lambda: None) -> dict[str, Any]:
    """µs per covered layer call that a prepared model adds over the plain one on a deep
    narrow model (module docstring), capture off and on, ``forward`` and ``fwd+bwd``: per
    round, each row runs ``number`` calls of each (rows rotated every round, one CPU thread);
    (min over ``rounds`` of the row's mean call − the plain model's) / covered calls. Clock:
    the calling thread's CPU time on CPU (``time.thread_time``: blind to other processes),
    wall time with ``sync`` elsewhere."""
    clock = time.thread_time if device == "cpu" else time.perf_counter
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        base = _deep_narrow(depth).to(device)
        x = torch.randn(2, 4, 2, 2, device=device)
        models = {"plain": copy.deepcopy(base)}
        for name, on in (("off", False), ("on", True)):
            models[name] = tengrad_fx.prepare(copy.deepcopy(base), example_inputs=(x,))
            tengrad_fx.capturing(models[name], on)
        calls = 2 * depth + 1
        work = {"forward": lambda net: net(x), "fwd+bwd": lambda net: net(x).sum().backward()}
        times: dict[tuple[str, str], list[float]] = {(n, w): [] for n in models for w in work}
        names = list(models)
        for r in range(rounds + 1):  # round 0: warm-up
            for i in range(len(names)):
                name = names[(i + r) % len(names)]
                for w, f in work.items():
                    sync()
                    t0 = clock()
                    for _ in range(number):
                        f(models[name])
                    sync()
                    if r:
                        times[(name, w)].append((clock() - t0) / number)
    finally:
        torch.set_num_threads(threads)
    out: dict[str, Any] = {"depth": depth, "covered_calls": calls, "device": device,
                           "plain_us": {w: min(times[("plain", w)]) * 1e6 for w in work}}
    for name in ("off", "on"):
        out[name] = {w: (min(times[(name, w)]) - min(times[("plain", w)])) / calls * 1e6 for w in work}
    return out


def report_launch_bound(res: dict[str, Any]) -> None:
    print(f"\nlaunch-bound: {res['depth']} x (Conv2d(4,4,1) + BatchNorm2d(4) + ReLU) + Linear, m=2, 2x2, "
          f"{res['covered_calls']} covered calls, 1 thread, device={res['device']} "
          f"({'thread CPU' if res['device'] == 'cpu' else 'wall'} time); "
          f"plain model: forward {res['plain_us']['forward']:.0f} us, fwd+bwd {res['plain_us']['fwd+bwd']:.0f} us")
    print(f"{'capture':<10}{'forward us/call':>17}{'fwd+bwd us/call':>17}   (over the plain model, min of rounds)")
    for name in ("off", "on"):
        print(f"{name:<10}{res[name]['forward']:>17.2f}{res[name]['fwd+bwd']:>17.2f}")


def main_capture(args: argparse.Namespace, base: nn.Module, batches: list[Any], sync: Callable[[], None]) -> dict:
    """``tools.bench --capture``: run, print, return the results."""
    res = run_capture(base, batches, args.steps, args.warmup, sync)
    report_capture(res, f"model={args.model} m={args.m} device={args.device} threads={torch.get_num_threads()} "
                        f"torch={torch.__version__}: forward + backward, median of {args.steps} interleaved "
                        f"rounds after {args.warmup} warm-up")
    calls = per_call(number=max(2, args.steps))
    report_per_call(calls)
    bound = launch_bound(rounds=max(2, args.steps), device=args.device, sync=sync)
    report_launch_bound(bound)
    return {"rows": res, "per_call": calls, "launch_bound": bound}


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description="the launch-bound table of tools.bench --capture alone")
    ap.add_argument("--depth", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--number", type=int, default=20)
    ap.add_argument("--device", default="cpu")
    a = ap.parse_args()
    report_launch_bound(launch_bound(a.depth, a.rounds, a.number, a.device,
                                     torch.cuda.synchronize if a.device == "cuda" else (lambda: None)))
