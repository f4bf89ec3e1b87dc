"""Per-layer Gram benchmark: ``factor`` vs ``materialize`` on the paper's 3C1F (or a
transposed-convolution decoder).

Run: ``python -m tools.gram_bench [--model 3c1f|decoder] [--m 128] [--threads 2] [--repeats 3]
[--max-gflop 2000] [--json out.json]``.

Prepares 3C1F (``tengrad_fx.zoo.get_model('3c1f')``) or :func:`decoder_local` (three
``ConvTranspose2d``, 4×4 → 32×32), runs one capturing forward/backward on a random batch
of ``m`` inputs, then times ``layer.gram(strategy)`` for both strategies on every covered
layer (median of ``--repeats``). A strategy whose cost-model estimate
(:func:`tengrad_fx.curvature.gram_flops`) exceeds ``--max-gflop`` is skipped, not run.
Also times a plain forward+backward (capture off) and a capturing one for reference.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any, Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

import tengrad_fx
from tengrad_fx.curvature import gram_flops
from tengrad_fx.zoo import get_model

STRATEGIES = ("factor", "materialize")


def decoder_local(num_classes: int = 10) -> nn.Module:
    """A DCGAN-like decoder: ``[m, 256, 4, 4]`` → three transposed convolutions → 32×32."""
    return nn.Sequential(
        nn.ConvTranspose2d(256, 128, 2, stride=2), nn.ReLU(),           # 4 -> 8
        nn.ConvTranspose2d(128, 64, 4, stride=2, padding=1), nn.ReLU(),  # 8 -> 16
        nn.ConvTranspose2d(64, 32, 4, stride=2, padding=1), nn.ReLU(),   # 16 -> 32
        nn.Conv2d(32, num_classes, 1), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
    )


MODELS: dict[str, tuple[int, ...]] = {"3c1f": (1, 28, 28), "decoder": (256, 4, 4)}  # input shapes


def build_model(name: str = "3c1f") -> tuple[nn.Module, str]:
    """``(model, description)``: the zoo's 3C1F or :func:`decoder_local`."""
    if name == "decoder":
        return decoder_local(), "transposed-conv decoder"
    return get_model("3c1f"), "tengrad_fx.zoo.get_model('3c1f')"


def median_ms(fn: Callable[[], Any], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def run(m: int = 128, threads: int = 2, repeats: int = 3, max_gflop: float = 2000.0,
        seed: int = 0, model_name: str = "3c1f") -> dict[str, Any]:
    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    model, source = build_model(model_name)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, *MODELS[model_name], generator=g)
    y = torch.randint(0, 10, (m,), generator=g)
    model = tengrad_fx.prepare(model, example_inputs=(x[:2],))

    def fwd_bwd() -> None:
        model.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()

    with tengrad_fx.capturing(model, False):
        fwd_bwd()  # warm-up
        plain_ms = median_ms(fwd_bwd, repeats)
    fwd_bwd()  # warm-up
    capture_ms = median_ms(fwd_bwd, repeats)  # the last call leaves this batch captured

    rows = []
    for layer in tengrad_fx.covered_layers(model):
        dims = layer.dims()
        est = gram_flops(layer.m, *dims)
        row: dict[str, Any] = dict(
            layer=layer.name, kind=layer.kind, dims=list(dims), auto=layer.choose("auto"),
            est_gflop={s: est[s] / 1e9 for s in STRATEGIES}, ms={}, skipped={},
        )
        grams: dict[str, torch.Tensor] = {}
        for s in STRATEGIES:
            if est[s] > max_gflop * 1e9:
                row["ms"][s] = None
                row["skipped"][s] = f"skipped: est. {est[s] / 1e9:.0f} GFLOP"
                continue
            t0 = time.perf_counter()
            grams[s] = layer.gram(s)  # kept for the agreement check
            first = (time.perf_counter() - t0) * 1e3
            if est[s] < 1e9:  # cheap: the first call was a warm-up
                row["ms"][s] = median_ms(lambda: layer.gram(s), repeats)  # noqa: B023
            else:  # seconds per call: first-call overhead is noise, count it
                row["ms"][s] = statistics.median(
                    [first] + [median_ms(lambda: layer.gram(s), 1) for _ in range(repeats - 1)])  # noqa: B023
        if len(grams) == 2:
            Kf, Km = grams["factor"].double(), grams["materialize"].double()
            row["rel_diff"] = ((Kf - Km).norm() / Km.norm()).item()
        rows.append(row)
    return dict(model=source, m=m, threads=threads, repeats=repeats, max_gflop=max_gflop,
                device="cpu", torch=torch.__version__, plain_fwd_bwd_ms=plain_ms,
                capture_fwd_bwd_ms=capture_ms, layers=rows)


def format_table(res: dict[str, Any]) -> str:
    head = (f"{'layer':<14} {'kind':<16} {'(g, S, f, o)':<22} {'est GFLOP fac':>13} {'est GFLOP mat':>13} "
            f"{'ms factor':>26} {'ms materialize':>26} {'auto':<11}")
    lines = [f"Gram benchmark: {res['model']}, m={res['m']}, threads={res['threads']}, "
             f"median of {res['repeats']}, torch {res['torch']}, {res['device']}",
             head, "-" * len(head)]

    def cell(r: dict[str, Any], s: str) -> str:
        v: Optional[float] = r["ms"][s]
        return r["skipped"][s] if v is None else f"{v:.1f}"

    for r in res["layers"]:
        dims = "(" + ", ".join(str(d) for d in r["dims"]) + ")"
        lines.append(f"{r['layer']:<14} {r['kind']:<16} {dims:<22} {r['est_gflop']['factor']:>13.3g} "
                     f"{r['est_gflop']['materialize']:>13.3g} {cell(r, 'factor'):>26} "
                     f"{cell(r, 'materialize'):>26} {r['auto']:<11}")
    lines.append("")
    lines.append(f"plain forward+backward (capture off): {res['plain_fwd_bwd_ms']:.1f} ms; "
                 f"capturing forward+backward: {res['capture_fwd_bwd_ms']:.1f} ms")
    both = [r for r in res["layers"] if "rel_diff" in r]
    if both:
        lines.append("factor vs materialize agreement (rel. Frobenius diff): " + ", ".join(
            f"{r['layer']} {r['rel_diff']:.1e}" for r in both))
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=sorted(MODELS), default="3c1f", help="network to prepare")
    ap.add_argument("--m", type=int, default=128, help="batch size")
    ap.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    ap.add_argument("--repeats", type=int, default=3, help="timed repeats (median reported)")
    ap.add_argument("--max-gflop", type=float, default=2000.0,
                    help="skip a strategy whose estimated cost exceeds this many GFLOP")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=str, default=None, help="also write the results here")
    a = ap.parse_args(argv)
    res = run(m=a.m, threads=a.threads, repeats=a.repeats, max_gflop=a.max_gflop, seed=a.seed,
              model_name=a.model)
    print(format_table(res))
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(res, fh, indent=2)


if __name__ == "__main__":
    main()
