"""When ``torch.compile`` pays off: TENGraD steps of an eager and a compiled prepared model,
interleaved in one process, and their ratio.

    python -m tools.compile_bench [--model tiny|3c1f|...] [--m 128] [--T 3] [--steps 12]
                                  [--fisher empirical|mc] [--device cpu|cuda] [--threads 2]

Both models start from the same weights and see the same batches; each round runs one step
of each (CUDA-synchronized), so machine noise hits both alike. The compilation is done
before timing (``tengrad_fx.cli._compile_warmup``) and printed apart. With ``--T 3`` the rounds hold
curvature steps (capture on) and reuse steps (capture off); the medians of each kind and of
the whole step are printed as ``compiled / eager``.
"""
from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from typing import Any

import torch
import torch.nn.functional as F

import tengrad_fx
from tengrad_fx.cli._compile_warmup import warm_up
from tengrad_fx.zoo.bench_models import build_model
from tengrad_fx.utils.memory import steady_malloc


def _step(fwd: Any, opt: Any, x: torch.Tensor, y: torch.Tensor, sync: bool) -> float:
    t0 = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    out = fwd(x)
    opt.mc_capture(out)
    F.cross_entropy(out, y).backward()
    opt.step()
    if sync:
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def run(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device)
    torch.manual_seed(0)
    base, shape = build_model(args.model)
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(args.m, *shape, generator=g).to(device) for _ in range(args.T)]
    ys = [torch.randint(0, 10, (args.m,), generator=g).to(device) for _ in range(args.T)]
    runs = {}
    for name in ("eager", "compiled"):
        pm = tengrad_fx.prepare(copy.deepcopy(base), example_inputs=(xs[0][:2].cpu(),)).to(device)
        opt = tengrad_fx.TENGraD(pm, lr=0.01, damping=0.1, momentum=0.9, curvature_every=args.T, fisher=args.fisher)
        fwd = torch.compile(pm) if name == "compiled" else pm
        compile_s = warm_up(fwd, pm, xs[0], ys[0], [args.m]) if name == "compiled" else 0.0
        runs[name] = (fwd, opt, compile_s, {"curvature": [], "reuse": []})
    sync = device.type == "cuda"
    for i in range(args.steps + args.T):  # the first T steps (one of each kind) are warm-up
        kind = "curvature" if i % args.T == 0 else "reuse"
        for fwd, opt, _, times in runs.values():
            t = _step(fwd, opt, xs[i % args.T], ys[i % args.T], sync)
            if i >= args.T:
                times[kind].append(t)
    out: dict[str, Any] = {"model": args.model, "m": args.m, "T": args.T, "fisher": args.fisher,
                           "device": str(device), "threads": torch.get_num_threads(), "torch": torch.__version__,
                           "compile_s": runs["compiled"][2]}
    for kind in ("curvature", "reuse"):
        e, c = runs["eager"][3][kind], runs["compiled"][3][kind]
        if e:
            out[kind] = {"eager_ms": 1e3 * statistics.median(e), "compiled_ms": 1e3 * statistics.median(c),
                         "ratio": statistics.median(b / a for a, b in zip(e, c))}
    e_all = sum(sum(v) for v in runs["eager"][3].values())
    c_all = sum(sum(v) for v in runs["compiled"][3].values())
    out["amortized_ratio"] = c_all / e_all
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--m", type=int, default=32)
    ap.add_argument("--T", type=int, default=3)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--fisher", default="empirical", choices=["empirical", "mc"])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device == "cpu":
        steady_malloc()
    out = run(args)
    print(f"{out['model']} m={out['m']} T={out['T']} {out['fisher']} on {out['device']} "
          f"({out['threads']} threads, torch {out['torch']}); compiled in {out['compile_s']:.1f} s (not timed)")
    for kind in ("curvature", "reuse"):
        if kind in out:
            r = out[kind]
            print(f"  {kind:9s} step: eager {r['eager_ms']:8.2f} ms  compiled {r['compiled_ms']:8.2f} ms  "
                  f"compiled/eager {r['ratio']:.3f}")
    print(f"  amortized over T={out['T']}: compiled/eager {out['amortized_ratio']:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
