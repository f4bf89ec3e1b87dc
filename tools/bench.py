"""Per-step time of SGD and TENGraD variants, interleaved in one process; ratios to SGD.

    python -m tools.bench [--model 3c1f|small|tiny|3c1f-bn|small-bn|tiny-bn|wrn-28-4|densenet-19|mobilenetv2]
                          [--m 128] [--steps 10] [--warmup 2] [--methods a,b,...|paper|all]
                          [--json out.json] [--memory] [--device cpu|cuda] [--threads 2]
                          [--ops] [--profile DIR] [--malloc steady|default]
    python -m tools.bench --capture [--model tiny] ...                # capture's forward+backward cost
    python -m tools.bench --distributed N [--model tiny] [--m 32] [--methods a,b]  # N gloo ranks: tools.dist_bench

Every method trains its own copy of the same initial model on the same random batches;
steps are interleaved (one step of each method per round) so machine noise hits all
alike; the median over rounds after warm-up is reported, with a breakdown into forward,
backward and optimizer step (TENGraD: gram, factorize, solve, apply). ``--memory`` runs
each method alone in a subprocess and reports its peak RSS (CPU) or peak CUDA memory.
On CUDA every phase ends with ``torch.cuda.synchronize()``. On a CPU the run first makes
glibc's heap steady (``--malloc steady``, the default; :func:`steady_malloc`): freed memory
stays in the process, so a step does not page-fault on what the previous one gave back to
the OS — as CUDA's caching allocator never gives memory back. With glibc's defaults
(``--malloc default``) every tensor over glibc's mmap threshold is fresh pages each step,
and the faults depend on the heap each method's last step left: on this 2-core VM they
made 3C1F's SGD step 734–919 ms instead of 468 ms, and ``tiny``'s T=1 MC backward 9.1
instead of 6.9 ms.

Rows with ``curvature_every = T > 1`` (``tengrad-T20``, ``tengrad-mc-T100``) report the
amortized step ``(curvature + (T−1)·reuse)/T`` in ``x SGD``: the reuse steps are measured
in the row, the curvature step is the T=1 row of the same Fisher (``tengrad`` or
``tengrad-mc``, added to the run if missing); ``reuse x`` is the reuse step alone over
SGD's. Beside them: the reuse step's curvature work (``J·g``, ``Jᵀc``, solves) in GFLOP
and MB (``TENGraD.reuse_cost``) and the measured ``solve`` time.

``--methods paper`` = sgd, tengrad (T=1 empirical), tengrad-mc (T=1 MC), tengrad-mc-T100
(MC, T=100, KL clip 0.01: the paper's protocol). ``--model tiny`` is the CPU proxy of the
launch-bound GPU regime: 3C1F with 8 channels, ``m = 32``, 1 thread (unless ``--m`` /
``--threads`` are given). ``--ops`` prints per method and step kind the aten ops one
warmed-up ``opt.step()`` dispatches (all / kernel-launching) and its host syncs;
``--profile DIR`` writes a ``torch.profiler`` trace per method and prints the top kernels
and the syncs per step (``tools.step_facts``). ``tengrad-grouped`` / ``tengrad-mc-grouped`` /
``tengrad-unfold``: T=1 rows whose per-sample conv gradients all use one method (the
grouped convolution, the only one before the per-layer rule; or unfold + bmm) instead of
the default rule (``tengrad_fx.capture.per_sample_conv``), in the same process.
"""
from __future__ import annotations

import argparse
import copy
import json
import re
import statistics
import subprocess
import sys
import time
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

import tengrad_fx
from tengrad_fx.capture.per_sample_conv import per_sample_conv_method
from tengrad_fx.utils.memory import steady_malloc
from tengrad_fx.optim.registry import make_optimizer
from tengrad_fx.zoo.bench_models import MODEL_NAMES, build_model
from tools import step_facts
from tools.capture_bench import main_capture
from tools.dist_bench import report_distributed, run_distributed, to_json

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
    # the paper's protocol: MC Fisher, inversion every 100 steps, KL clip 0.01
    "tengrad-mc-T100": (lambda mdl: make_optimizer("tengrad", mdl, _FM, fisher="mc", curvature_every=100,
                                                  kl_clip=0.01), True),
    # the same step under torch.compile, and without CUDA graphs (the default replays reuse steps on CUDA)
    "tengrad-compile": (lambda mdl: make_optimizer("tengrad", mdl, _FM, curvature_every=1, compile=True,
                                                   **_EMP), True),
    "tengrad-mc-T100-compile": (lambda mdl: make_optimizer("tengrad", mdl, _FM, fisher="mc", curvature_every=100,
                                                          kl_clip=0.01, compile=True), True),
    "tengrad-mc-T100-eager": (lambda mdl: make_optimizer("tengrad", mdl, _FM, fisher="mc", curvature_every=100,
                                                        kl_clip=0.01, cuda_graph=False), True),
    # Linear/Conv preconditioned only: norm layers and added parameters left to SGD-momentum
    "tengrad-linconv": (lambda mdl: make_optimizer("tengrad", mdl, _FM, curvature_every=1, **_EMP),
                        {"only_linear_conv": True}),
    "tengrad-tf32": (lambda mdl: make_optimizer("tengrad", mdl, _FM, curvature_every=1, gram_tf32=True, **_EMP),
                     True),
    "tengrad-mc-T100-linconv": (lambda mdl: make_optimizer("tengrad", mdl, _FM, fisher="mc", curvature_every=100,
                                                          kl_clip=0.01), {"only_linear_conv": True}),
    # the preset "orthogonal" (RMSProp-grafted biases) with Newton-Schulz polar factors, at the paper's T = 100
    "tengrad-orth-ns-T100": (lambda mdl: make_optimizer("tengrad", mdl, _FM, preset="orthogonal",
                                                        orthogonalize="newton-schulz"), True),
    # every layer's J kept (4 GiB budget): reuse steps by GEMVs on P only, no factored convs
    "tengrad-mc-T100-budget4g": (lambda mdl: make_optimizer("tengrad", mdl, _FM, fisher="mc", curvature_every=100,
                                                           kl_clip=0.01, jacobian_budget_mb=4096), True),
    # per-sample conv gradients all by one grouped weight-gradient convolution (the method
    # before the per-layer rule of tengrad_fx.capture.per_sample_conv; CONV_METHOD below)
    "tengrad-grouped": (lambda mdl: make_optimizer("tengrad", mdl, _FM, curvature_every=1, **_EMP), True),
    "tengrad-mc-grouped": (lambda mdl: make_optimizer("tengrad", mdl, _FM, curvature_every=1, fisher="mc"), True),
    "tengrad-unfold": (lambda mdl: make_optimizer("tengrad", mdl, _FM, curvature_every=1, **_EMP), True),
    # baselines at T = 1 (statistics and inverses every step) and at their paper intervals
    "kfac-T1": (lambda mdl: make_optimizer("kfac", mdl, _FM, curvature_every=1, inverse_every=1, **_EMP), True),
    "kfac": (lambda mdl: make_optimizer("kfac", mdl, _FM, **_EMP), True),
    "ekfac-T1": (lambda mdl: make_optimizer("ekfac", mdl, _FM, curvature_every=1, inverse_every=1, rescale_every=1,
                                            **_EMP), True),
    "ekfac": (lambda mdl: make_optimizer("ekfac", mdl, _FM, **_EMP), True),
    "kbfgs-T1": (lambda mdl: make_optimizer("kbfgs", mdl, _FM, curvature_every=1, inverse_every=1), True),
    "kbfgs": (lambda mdl: make_optimizer("kbfgs", mdl, _FM), True),
}
CONV_METHOD = {"tengrad-grouped": "grouped", "tengrad-mc-grouped": "grouped", "tengrad-unfold": "unfold"}
"""Rows whose steps run under ``per_sample_conv_method(...)`` (the rest use the default)."""
BASELINES = "kfac-T1,kfac,ekfac-T1,ekfac,kbfgs-T1,kbfgs"


PAPER_ROWS = "sgd,tengrad,tengrad-mc,tengrad-mc-T100"


def method_list(spec: str) -> list[str]:
    """``--methods``: a comma list, ``paper`` or ``all``; T>1 TENGraD rows bring their T=1 row."""
    if spec == "paper":
        spec = PAPER_ROWS
    elif spec == "all":
        spec = "sgd,tengrad,tengrad-mc,tengrad-T20,tengrad-mc-T100," + BASELINES
    out = spec.split(",")
    for meth in list(out):
        base = curvature_row(meth)
        if base and base not in out:
            out.insert(out.index(meth), base)
    return out


def period(method: str) -> int:
    """``T`` of a TENGraD row: ``tengrad-mc-T100-eager`` → 100, rows without ``-T<n>`` → 1."""
    found = re.search(r"-T(\d+)", method)
    return int(found.group(1)) if method.startswith("tengrad") and found else 1


def curvature_row(method: str) -> str | None:
    """The eager T=1 row of the same Fisher whose step is a T>1 row's curvature step."""
    if period(method) == 1:
        return None
    return "tengrad-mc" if "-mc" in method else "tengrad"


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
        self.conv_method = CONV_METHOD.get(method)

    def step(self, x: torch.Tensor, y: torch.Tensor, sync: Callable[[], None],
             wrap_step: Callable[[Callable[[], Any]], Any] | None = None) -> None:
        if self.conv_method is None:
            return self._step(x, y, sync, wrap_step)
        with per_sample_conv_method(self.conv_method):
            return self._step(x, y, sync, wrap_step)

    def is_curvature_step(self) -> bool:
        check = getattr(self.opt, "_is_curvature_step", None)
        return bool(check()) if check is not None else True

    def _step(self, x: torch.Tensor, y: torch.Tensor, sync: Callable[[], None],
              wrap_step: Callable[[Callable[[], Any]], Any] | None) -> None:
        curvature = self.is_curvature_step()
        sync()
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
        if wrap_step is None:
            self.opt.step()
        else:
            wrap_step(self.opt.step)
        sync()
        t3 = time.perf_counter()
        row = {"total": t3 - t0, "forward": t1 - t0, "backward": t2 - t1, "step": t3 - t2,
               "reuse": 0.0 if curvature else 1.0}
        row.update(getattr(self.opt, "timings", {}))
        self.times.append(row)

    def summary(self, warmup: int) -> dict[str, float]:
        """Medians after warm-up; for T>1 rows over the reuse steps (amortized in main)."""
        rows = self.times[warmup:]
        reuse = [r for r in rows if r["reuse"]]
        use = reuse or rows
        out = {k: statistics.median(r.get(k, 0.0) for r in use) for k in rows[0]}
        out["reuse"] = float(bool(reuse))
        cost = getattr(self.opt, "reuse_cost", None)
        if reuse and cost is not None:
            flops, nbytes = cost()
            out["reuse_gflop"], out["reuse_mb"] = flops / 1e9, nbytes / 2**20
        return out


def setup(args: argparse.Namespace) -> tuple[torch.device, Callable[[], None], nn.Module, list[Any]]:
    """``(device, sync, initial model, 4 random batches)`` of a run."""
    torch.manual_seed(0)
    dev = torch.device(args.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    base, shape = build_model(args.model)
    base = base.to(dev)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(args.m, *shape, generator=g).to(dev),
                torch.randint(0, 10, (args.m,), generator=g).to(dev)) for _ in range(4)]
    return dev, sync, base, batches


def run(args: argparse.Namespace) -> dict[str, Any]:
    dev, sync, base, batches = setup(args)
    # a peak-memory subprocess runs its one method alone (not with the T=1 row of a T>1 row)
    methods = args.methods.split(",") if getattr(args, "report_peak", False) else method_list(args.methods)
    runners = [Runner(m, base, batches[0][0]) for m in methods]
    for r in range(args.warmup + args.steps):
        x, y = batches[r % len(batches)]
        for run_ in runners:
            run_.step(x, y, sync)
    res = {r.method: r.summary(args.warmup) for r in runners}
    out = {"model": args.model, "m": args.m, "device": str(dev), "threads": torch.get_num_threads(),
           "steps": args.steps, "torch": torch.__version__, "results": res}
    if getattr(args, "ops", False):
        out["ops"] = step_facts.ops_table(runners, batches[0], sync)
    if getattr(args, "profile", None):
        out["profile"] = step_facts.profile(runners, batches[0], sync, args.profile)
    return out


def amortize(res: dict[str, dict[str, float]]) -> None:
    """``amortized`` total of every row: T>1 rows ``(curvature + (T−1)·reuse)/T`` with the
    curvature step from the T=1 row of the same Fisher (module docstring)."""
    for meth, r in res.items():
        r["amortized"] = r["total"]
        T, base = period(meth), res.get(curvature_row(meth) or "")
        if T > 1 and r["reuse"] and base:
            r["amortized"] = (base["total"] + (T - 1) * r["total"]) / T


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
    ap.add_argument("--m", type=int, default=None, help="batch size (default 128; tiny: 32)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--methods", default=None,
                    help=f"comma list of {sorted(METHODS)} (default sgd,tengrad,tengrad-mc,tengrad-T20); "
                         f"'paper' = {PAPER_ROWS}; 'all' adds the baselines ({BASELINES}): on CPU use them "
                         "with --model small (K-FAC's 10369² factor of 3C1F is slow); --distributed: a comma "
                         "list of tools.dist_bench.METHODS (default all)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=None, help="CPU threads (default 2; tiny: 1)")
    ap.add_argument("--ops", action="store_true", help="print aten ops and host syncs per opt.step()")
    ap.add_argument("--profile", default=None, metavar="DIR", help="torch.profiler traces + top kernels")
    ap.add_argument("--json", default=None)
    ap.add_argument("--malloc", default="steady", choices=["steady", "default"],
                    help="CPU: glibc heap kept steady (no page faults from memory given back; default) "
                         "or glibc's defaults")
    ap.add_argument("--memory", action="store_true", help="also measure each method's peak memory "
                    "(each alone, glibc's defaults)")
    ap.add_argument("--_report-peak", dest="report_peak", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--capture", action="store_true",
                    help="forward+backward only: capture on / off / custom ops / unprepared (tools.capture_bench)")
    ap.add_argument("--distributed", type=int, default=0, metavar="N",
                    help="distributed TENGraD vs DDP-SGD on N gloo ranks, --m per rank (tools.dist_bench)")
    ap.add_argument("--bandwidth", type=float, default=50e9, help="--distributed: the cost model's bytes/s")
    ap.add_argument("--flop-rate", type=float, default=50e12, help="--distributed: the cost model's flop/s")
    args = ap.parse_args(argv)
    tiny = args.model.startswith("tiny")
    args.m = args.m or (32 if tiny else 128)
    args.threads = args.threads or (1 if tiny else 2)
    torch.set_num_threads(args.threads)
    if args.distributed:
        ranks = run_distributed(args.distributed, args.model, args.m, args.steps, args.warmup, args.threads,
                                args.bandwidth, args.flop_rate, args.methods)
        print(report_distributed(ranks, args.distributed, args.model, args.m))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(to_json(ranks), f, indent=2)
        return
    args.methods = args.methods or "sgd,tengrad,tengrad-mc,tengrad-T20"
    if args.capture:
        _, sync, base, batches = setup(args)
        res = main_capture(args, base, batches, sync)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(res, f, indent=2)
        return
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
    steady = args.device == "cpu" and args.malloc == "steady" and steady_malloc()
    args.malloc = "steady" if steady else "default"
    out = run(args)
    out["malloc"] = args.malloc
    if args.memory:
        for meth in out["results"]:
            out["results"][meth]["peak_mib"] = peak_memory(args, meth)
    report(out, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


def report(out: dict[str, Any], args: argparse.Namespace) -> None:
    """Print the timing table (and the ops / profile tables when measured)."""
    res = out["results"]
    amortize(res)
    base = res.get("sgd")
    print(f"model={out['model']} m={out['m']} device={out['device']} threads={out['threads']} "
          f"torch={out['torch']} malloc={out.get('malloc', 'default')} median of {args.steps} interleaved steps "
          f"after {args.warmup} warm-up")
    cols = ["total", "forward", "backward", "step", "gram", "factorize", "solve", "apply"]
    print(f"{'method':<24}" + "".join(f"{c + ' ms':>11}" for c in cols) + f"{'x SGD':>8}{'reuse x':>8}"
          + f"{'reuse GFLOP':>12}{'reuse MB':>9}" + (f"{'peak MiB':>10}{'mem x SGD':>10}" if args.memory else ""))
    for meth, r in res.items():
        r["ratio_to_sgd"] = ratio = r["amortized"] / base["total"] if base else float("nan")
        reuse = f"{r['total'] / base['total']:>8.3f}" if base and r["reuse"] else f"{'':>8}"
        line = f"{meth:<24}" + "".join(f"{r.get(c, 0.0) * 1e3:>11.1f}" for c in cols) + f"{ratio:>8.3f}" + reuse
        line += f"{r['reuse_gflop']:>12.3f}{r['reuse_mb']:>9.1f}" if "reuse_gflop" in r else f"{'':>21}"
        if args.memory:
            r["mem_ratio_to_sgd"] = mr = r["peak_mib"] / base["peak_mib"] if base else float("nan")
            line += f"{r['peak_mib']:>10.0f}{mr:>10.3f}"
        print(line)
    if "ops" in out:
        print("\naten ops per warmed-up opt.step() (kernels = non-view ops), host syncs")
        print(f"{'method':<24}{'kind':>10}{'ops':>8}{'kernels':>9}{'syncs':>7}")
        for row in out["ops"]:
            print(f"{row['method']:<24}{row['kind']:>10}{row['ops']:>8}{row['kernels']:>9}{row['syncs']:>7}")
    for meth, p in out.get("profile", {}).items():
        print(f"\n{meth}: trace {p['trace']}, host syncs per opt.step() {p['syncs_per_step']:.1f}; top kernels:")
        for name, calls, ms in p["top"]:
            print(f"  {ms:9.3f} ms/step {calls:6d} calls/step  {name[:90]}")


if __name__ == "__main__":
    main()
