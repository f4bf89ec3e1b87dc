"""TENGraD option ablation against its paper settings and peers: steps to target accuracies.

    python -m tools.ablate [--variants paper,lr3,...] [--tengrad 'NAME:key=value,key=value']...
                           [--peers sgd,muon,soap] [--seeds 0,1,2] [--steps 300] [--batch-size 128]
                           [--eval-every 25] [--eval-subset 2000] [--targets 0.85,0.88]
                           [--at 25,100,300] [--schedule constant|cosine] [--threads 1]
                           [--data-dir DIR] [--out DIR]

Every TENGraD variant is ``make_optimizer("tengrad", model, "fashion-mnist", **opts)`` (an
option ``preset=NAME`` stands for that preset's options, ``registry.PRESETS``): the
paper's Fashion-MNIST settings (MC Fisher, curvature every 100 steps, KL clip 0.01,
damping 0.1, lr 0.003, weight decay 1e-3, momentum 0.9) with ``opts`` on top. Named
variants are ``VARIANTS``; ``--tengrad 'name:curvature_every=1,damping=0.03'`` adds one
(values: int, float, ``None``, ``True``/``False`` or a string). ``--peers`` are methods of
:mod:`tools.peer_methods` (``sgd``, ``adamw``, ``muon``, ``soap``, ...), at their default lr
or, written ``muon@0.06``, at that lr.

Per seed, every run starts from the same initial weights and sees the same batches, in
lockstep (:mod:`tools.peer_bench`'s ``Run``), every lr following ``--schedule`` over
``--steps`` (``tools.peer_bench.lr_multiplier``; default constant); test accuracy on a fixed ``--eval-subset``
of the test set every ``--eval-every`` steps. The table gives, per variant over the
seeds, mean ± half the range (min–max / 2) of the steps to each target (the first
evaluation at or above it; a seed that never reaches it counts as missing, and the
count of seeds that reached it is shown) and of the accuracy at the ``--at`` steps.
Only step counts are reported: step times on a shared machine are not a speed measure.

Outputs under ``--out``: ``results.json`` (config, every run's curve) and ``table.md``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
from dataclasses import replace
from typing import Any

import torch

from tengrad_fx.zoo.bench_models import build_model
from tools.peer_bench import SCHEDULES, Run, batch_order, evaluate, load_data, make_run, to_target
from tools.peer_methods import METHODS, Method, parse_variant, tengrad_method

_FM = "fashion-mnist"

VARIANTS: dict[str, dict[str, Any]] = {
    "paper": {},
    "lr3": {"lr": 0.009},
    "lr10": {"lr": 0.03},
    "damp0.03": {"damping": 0.03},
    "damp0.01": {"damping": 0.01},
    "kl0.1": {"kl_clip": 0.1},
    "empirical": {"fisher": "empirical"},
    "T10": {"curvature_every": 10},
    "T1": {"curvature_every": 1},
    "T1-lr3": {"curvature_every": 1, "lr": 0.009},
    "lr3-damp0.03": {"lr": 0.009, "damping": 0.03},
    "lr3-grow2": {"lr": 0.009, "curvature_growth": 2.0},
    "rms1e-4": {"graft": "rmsprop", "lr": 1e-4},
    "rms3e-4": {"graft": "rmsprop", "lr": 3e-4},
    "rms6e-4": {"graft": "rmsprop", "lr": 6e-4},
    "rms3e-4-grow2": {"graft": "rmsprop", "lr": 3e-4, "curvature_growth": 2.0},
    "fast": {"preset": "fast"},
    "orth": {"preset": "orthogonal"},
    "orth-nongd": {"preset": "orthogonal", "damping": 1e3},
}
"""Named TENGraD variants: keyword overrides of the paper's Fashion-MNIST settings."""


def peer_method(spec: str) -> Method:
    """``"muon"``: the peer at its default lr; ``"muon@0.06"``: at lr 0.06 (named so)."""
    name, _, lr = spec.partition("@")
    return replace(METHODS[name], name=spec, lr=float(lr)) if lr else METHODS[name]


def run_seed(args: argparse.Namespace, methods: list[Method], seed: int) -> list[dict[str, Any]]:
    """Train every method from seed ``seed`` in lockstep; returns one curve per method."""
    args.seed = seed
    train_set, xt, yt = load_data(args, torch.device("cpu"))
    torch.manual_seed(seed)
    base = build_model(args.model)[0]
    runs: list[Run] = [make_run(m, m.lr, base, train_set.x[:2], args.schedule, args.steps) for m in methods]
    for run in runs:
        if hasattr(run.opt, "seed_mc"):
            run.opt.seed_mc(seed)
    for run in runs:
        run.curve.append({"step": 0, "test_acc": evaluate(run.model, xt, yt)[1]})
    for step, idx in enumerate(batch_order(len(train_set), args.batch_size, args.steps, seed), 1):
        x, y = train_set.x.index_select(0, idx), train_set.y.index_select(0, idx)
        for run in runs:
            if run.diverged_at is None:
                run.step(x, y, lambda: None)
        if step % args.eval_every == 0 or step == args.steps:
            for run in runs:
                if run.diverged_at is None:
                    loss, acc = evaluate(run.model, xt, yt)
                    run.curve.append({"step": step, "test_acc": acc, "test_loss": loss})
            if args.verbose:
                print(f"seed {seed} step {step}: " + ", ".join(f"{r.method.name} {r.curve[-1]['test_acc']:.3f}"
                                                              for r in runs), flush=True)
    return [{"method": r.method.name, "seed": seed, "settings": r.method.settings, "diverged_at": r.diverged_at,
             "curve": r.curve} for r in runs]


def _acc_at(curve: list[dict[str, Any]], step: int) -> float | None:
    return next((c["test_acc"] for c in curve if c["step"] == step), None)


def _mean_spread(xs: list[float], fmt: str) -> str:
    if not xs:
        return "–"
    half = (max(xs) - min(xs)) / 2
    return f"{format(statistics.fmean(xs), fmt)} ± {format(half, fmt)}"


def table(rows: list[dict[str, Any]], targets: list[float], at: list[int]) -> str:
    """The markdown table of the module docstring, one line per method (first-seen order)."""
    names = list(dict.fromkeys(r["method"] for r in rows))
    n_seeds = len({r["seed"] for r in rows})
    head = ["variant"] + [f"steps to {t:.0%}" for t in targets] + [f"acc. @ {s}" for s in at]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name in names:
        mine = [r for r in rows if r["method"] == name]
        cells = [name]
        for t in targets:
            hits = [h["step"] for h in (to_target(r["curve"], t) for r in mine) if h is not None]
            cells.append(_mean_spread([float(h) for h in hits], ".0f") + ("" if len(hits) == len(mine) else
                                                                          f" ({len(hits)}/{len(mine)})"))
        for s in at:
            accs = [a * 100 for a in (_acc_at(r["curve"], s) for r in mine) if a is not None]
            cells.append(_mean_spread(accs, ".1f"))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + f"\n\n{n_seeds} seed(s); mean ± half the min–max range.\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", default="paper", help=f"comma list of {sorted(VARIANTS)} ('' for none)")
    ap.add_argument("--tengrad", action="append", default=[], help="'name:key=value,...' (repeatable)")
    ap.add_argument("--peers", default="", help=f"comma list of {sorted(METHODS)}, each NAME or NAME@LR")
    ap.add_argument("--model", default="3c1f")
    ap.add_argument("--dataset", default=_FM)
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--subset", type=int, default=0)
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--eval-every", type=int, default=25)
    ap.add_argument("--eval-subset", type=int, default=2000)
    ap.add_argument("--targets", default="0.85,0.88")
    ap.add_argument("--at", default="25,100,300", help="steps whose accuracy the table shows")
    ap.add_argument("--schedule", default="constant", choices=SCHEDULES)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default=None)
    ap.add_argument("--verbose", action="store_true")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    unknown = [v for v in filter(None, args.variants.split(",")) if v not in VARIANTS]
    unknown += [p for p in filter(None, args.peers.split(",")) if p.partition("@")[0] not in METHODS]
    if unknown:
        ap.error(f"unknown variants/peers {unknown}; variants: {sorted(VARIANTS)}, peers: {sorted(METHODS)}")
    specs = [(v, VARIANTS[v]) for v in filter(None, args.variants.split(","))]
    specs += [parse_variant(s) for s in args.tengrad]
    methods = [tengrad_method(n, o) for n, o in specs] + [peer_method(p) for p in filter(None, args.peers.split(","))]
    if not methods:
        ap.error("nothing to run: give --variants, --tengrad or --peers")
    targets = [float(t) for t in args.targets.split(",") if t]
    at = [int(s) for s in args.at.split(",") if s]
    rows = [row for seed in (int(s) for s in args.seeds.split(",")) for row in run_seed(args, methods, seed)]
    text = table(rows, targets, at)
    print(text)
    res = {"config": {k: v for k, v in vars(args).items() if k not in ("out", "verbose")}, "runs": rows}
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "results.json"), "w") as f:
            json.dump(res, f, indent=2)
        with open(os.path.join(args.out, "table.md"), "w") as f:
            f.write(text)
    return res


if __name__ == "__main__":
    main()
