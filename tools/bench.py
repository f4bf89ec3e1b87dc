"""Per-step time of SGD and TENGraD variants, interleaved in one process; ratios to SGD.

    python -m tools.bench [--model 3c1f|small|3c1f-bn|small-bn] [--m 128] [--steps 10] [--warmup 2]
                          [--methods sgd,tengrad,tengrad-mc,tengrad-T20] [--json out.json]
                          [--memory] [--device cpu|cuda] [--threads 2]

Every method trains its own copy of the same initial model on the same random batches;
steps are interleaved (one step of each method per round) so machine noise hits all
alike; the median over rounds after warm-up is reported, with a breakdown into forward,
backward and optimizer step (TENGraD: gram, factorize, solve, apply). ``--memory`` runs
each method alone in a subprocess and reports its peak RSS (CPU) or peak CUDA memory.
"""
from __future__ import annotations

import argparse
import copy
import json
import statistics
import subprocess
import sys
import time
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

import tengrad_fx
from tengrad_fx.optim.registry import make_optimizer

# name -> (constructor of an optimizer over (prepared or plain) model, needs prepare).
# All with the paper's Fashion-MNIST lr / wd / damping (tengrad_fx.optim.registry); the
# Fisher and periods are pinned per row (the registry's paper settings use MC and T = 100).
_FM = "fashion-mnist"
_EMP = dict(fisher="empirical")
METHODS: dict[str, tuple[Callable[[nn.Module], torch.optim.Optimizer], bool | dict[str, Any]]] = {
    "sgd": (lambda mdl: torch.optim.SGD(mdl.parameters(), lr=0.03, momentum=0.9, weight_decay=1e-3), False),
    "tengrad": (lambda mdl: make_optimizer("tengrad", mdl, _FM, curvature_every=1, **_EMP), True),
    "tengrad-mc": (lambda mdl: make_optimizer("tengrad", mdl, _FM, curvature_every=1, fisher="mc"), True),
    "tengrad-T20": (lambda mdl: make_optimizer("tengrad", mdl, _FM, curvature_every=20, **_EMP), True),
    # Linear/Conv preconditioned only: norm layers and added parameters left to SGD-momentum
    "tengrad-linconv": (lambda mdl: make_optimizer("tengrad", mdl, _FM, curvature_every=1, **_EMP),
                        {"only_linear_conv": True}),
    # baselines at T = 1 (statistics and inverses every step) and at their paper intervals
    "kfac-T1": (lambda mdl: make_optimizer("kfac", mdl, _FM, TCov=1, TInv=1, **_EMP), True),
    "kfac": (lambda mdl: make_optimizer("kfac", mdl, _FM, **_EMP), True),
    "ekfac-T1": (lambda mdl: make_optimizer("ekfac", mdl, _FM, TCov=1, TInv=1, TScal=1, **_EMP), True),
    "ekfac": (lambda mdl: make_optimizer("ekfac", mdl, _FM, **_EMP), True),
    "kbfgs-T1": (lambda mdl: make_optimizer("kbfgs", mdl, _FM, TCov=1, TInv=1), True),
    "kbfgs": (lambda mdl: make_optimizer("kbfgs", mdl, _FM), True),
}
BASELINES = "kfac-T1,kfac,ekfac-T1,ekfac,kbfgs-T1,kbfgs"


MODEL_NAMES = ("3c1f", "small", "3c1f-bn", "small-bn")


def build_model(name: str) -> nn.Module:
    """``3c1f``: the paper's model (Conv 1→128→128→128, MaxPool 3, Linear 10368→500→10);
    ``small``: the same with 32 channels; ``-bn``: a BatchNorm2d after each conv and a
    BatchNorm1d after the first Linear."""
    c = {"3c1f": 128, "small": 32}[name.removesuffix("-bn")]
    bn = name.endswith("-bn")
    norm2 = (lambda: nn.BatchNorm2d(c)) if bn else nn.Identity  # noqa: E731
    return nn.Sequential(
        nn.Conv2d(1, c, 3, padding=1), norm2(), nn.ReLU(), nn.Conv2d(c, c, 3, padding=1), norm2(), nn.ReLU(),
        nn.Conv2d(c, c, 3, padding=1), norm2(), nn.ReLU(), nn.MaxPool2d(3), nn.Flatten(),
        nn.Linear(9 * 9 * c, 500), nn.BatchNorm1d(500) if bn else nn.Identity(), nn.ReLU(), nn.Linear(500, 10),
    )


class Runner:
    """One method's model, optimizer and step with a timing breakdown."""

    def __init__(self, method: str, base: nn.Module, example: torch.Tensor):
        make, prep = METHODS[method]
        self.method = method
        model = copy.deepcopy(base)
        kw = prep if isinstance(prep, dict) else {}
        self.model = tengrad_fx.prepare(model, example_inputs=(example[:2],), **kw) if prep else model
        self.opt = make(self.model)
        self.times: list[dict[str, float]] = []

    def step(self, x: torch.Tensor, y: torch.Tensor, sync: Callable[[], None]) -> None:
        t0 = time.perf_counter()
        self.opt.zero_grad(set_to_none=True)
        out = self.model(x)
        loss = F.cross_entropy(out, y)
        sync()
        t1 = time.perf_counter()
        if hasattr(self.opt, "mc_capture"):
            self.opt.mc_capture(out)
        loss.backward()
        sync()
        t2 = time.perf_counter()
        self.opt.step()
        sync()
        t3 = time.perf_counter()
        row = {"total": t3 - t0, "forward": t1 - t0, "backward": t2 - t1, "step": t3 - t2}
        row.update(getattr(self.opt, "timings", {}))
        self.times.append(row)

    def summary(self, warmup: int) -> dict[str, float]:
        rows = self.times[warmup:]
        return {k: statistics.median(r.get(k, 0.0) for r in rows) for k in rows[0]}


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.manual_seed(0)
    dev = torch.device(args.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    base = build_model(args.model).to(dev)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(args.m, 1, 28, 28, generator=g).to(dev),
                torch.randint(0, 10, (args.m,), generator=g).to(dev)) for _ in range(4)]
    methods = args.methods.split(",") if args.methods != "all" else \
        ["sgd", "tengrad", "tengrad-mc", "tengrad-T20", *BASELINES.split(",")]
    runners = [Runner(m, base, batches[0][0]) for m in methods]
    for r in range(args.warmup + args.steps):
        x, y = batches[r % len(batches)]
        for run_ in runners:
            run_.step(x, y, sync)
    res = {r.method: r.summary(args.warmup) for r in runners}
    return {"model": args.model, "m": args.m, "device": str(dev), "threads": torch.get_num_threads(),
            "steps": args.steps, "torch": torch.__version__, "results": res}


def peak_memory(args: argparse.Namespace, method: str) -> float:
    """Peak memory (MiB) of ``method`` alone: RSS of a subprocess, or CUDA peak."""
    cmd = [sys.executable, "-m", "tools.bench", "--model", args.model, "--m", str(args.m),
           "--steps", "3", "--warmup", "1", "--methods", method, "--device", args.device,
           "--threads", str(args.threads), "--_report-peak"]
    out = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=True).stdout
    return float(out.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="3c1f", choices=list(MODEL_NAMES))
    ap.add_argument("--m", type=int, default=128)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--methods", default="sgd,tengrad,tengrad-mc,tengrad-T20",
                    help=f"comma list of {sorted(METHODS)}; 'all' adds the baselines ({BASELINES}): "
                         "on CPU use them with --model small (K-FAC's 10369² factor of 3C1F is slow)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    ap.add_argument("--memory", action="store_true", help="also measure each method's peak memory")
    ap.add_argument("--_report-peak", dest="report_peak", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.report_peak:
        if args.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        run(args)
        if args.device == "cuda":
            print(torch.cuda.max_memory_allocated() / 2**20)
        else:  # VmHWM: this process's own peak (ru_maxrss would include the parent's, kept across exec)
            with open("/proc/self/status") as f:
                hwm = next(line for line in f if line.startswith("VmHWM:"))
            print(int(hwm.split()[1]) / 1024)
        return
    out = run(args)
    if args.memory:
        for meth in out["results"]:
            out["results"][meth]["peak_mib"] = peak_memory(args, meth)
    base = out["results"].get("sgd")
    print(f"model={out['model']} m={out['m']} device={out['device']} threads={out['threads']} "
          f"torch={out['torch']} median of {args.steps} interleaved steps after {args.warmup} warm-up")
    cols = ["total", "forward", "backward", "step", "gram", "factorize", "solve", "apply"]
    print(f"{'method':<13}" + "".join(f"{c + ' ms':>12}" for c in cols) + f"{'x SGD':>8}"
          + (f"{'peak MiB':>10}{'mem x SGD':>10}" if args.memory else ""))
    for meth, r in out["results"].items():
        ratio = r["total"] / base["total"] if base else float("nan")
        r["ratio_to_sgd"] = ratio
        line = f"{meth:<13}" + "".join(f"{r.get(c, 0.0) * 1e3:>12.1f}" for c in cols) + f"{ratio:>8.3f}"
        if args.memory:
            mr = r["peak_mib"] / base["peak_mib"] if base else float("nan")
            r["mem_ratio_to_sgd"] = mr
            line += f"{r['peak_mib']:>10.0f}{mr:>10.3f}"
        print(line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
