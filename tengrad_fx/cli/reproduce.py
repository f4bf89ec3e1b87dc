"""Reproduce a row of the paper's Table 2 with one command.

    tengrad-reproduce fmnist                        # SGD, TENGraD, K-FAC, EK-FAC, KBFGS on 3C1F
    tengrad-reproduce fmnist --methods tengrad      # the README's main command
    tengrad-reproduce fmnist --seeds 5
    tengrad-reproduce cifar10 --model wrn-28-4 --data-dir ~/data
    tengrad-reproduce cifar100 --model densenet-19 --data-dir ~/data

(also ``python -m tengrad_fx.cli.reproduce``). Every method runs with the paper's settings
(:func:`tengrad_fx.optim.registry.paper_settings`: tuned lr / weight decay / damping for the
(dataset, model) row, momentum 0.9, MC Fisher, TENGraD's curvature every 100 steps, the
baselines' statistics every 20 / inversion every 100, KL clip 0.01) and the paper's
protocol: batch 128, no augmentation on Fashion-MNIST (CIFAR: random crop + flip, as the
zoo's CIFAR datasets do), 10 epochs at constant lr on Fashion-MNIST, 60 epochs on CIFAR
with lr halved every 10 epochs (CIFAR-10) or ×0.1 at epochs 30 and 45 (CIFAR-100).
Each (method, seed) is one ``tengrad_fx.cli.train`` run (in this process) in ``OUT/<method>-s<seed>``;
a finished run with the same settings is reused, so an interrupted reproduction continues.

Output: the Table-2 row beside the paper's (top test accuracy over the evaluated epochs,
training seconds until that epoch, training seconds until the paper's SGD accuracy, mean
± std over seeds), ``OUT/curves.png`` / ``.svg`` (loss and test accuracy vs epoch and vs
training seconds, :func:`tengrad_fx.cli.plot.plot_runs`), ``OUT/curves.csv`` (one row per method,
seed and evaluation) and ``OUT/table.csv`` (the row).

``--distributed`` (under ``torchrun``, like ``tengrad_fx.cli.train --distributed``): every run is a
``tengrad_fx.cli.train --distributed`` run of this process group — DDP + ``DistributedTENGraD``
(global-batch Fisher) or DDP-SGD; the batch 128 is the global one (a multiple of the
world size), each rank trains on its block of it; only rank 0 prints and writes (the
table, CSVs, plot; the runs' logs and checkpoints); rank 0 decides which finished runs
are reused and tells the others. Methods: ``sgd`` and ``tengrad`` (the default then;
the K-FAC family has no distributed mode)::

    torchrun --nproc_per_node=8 -m tengrad_fx.cli.reproduce cifar10 --distributed --data-dir ~/data

``--device`` defaults to CUDA when available. On a CPU the full protocol takes hours, so
unless ``--full`` is given a CPU run is scaled down to ``--subset 6400`` training images
and ``--epochs 1`` (the test accuracy is still on the whole test set); the output says
so. ``--epochs`` / ``--subset`` set the scale explicitly on any device.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import sys
import time
from typing import Any, Optional, Sequence

import torch

from ..optim.registry import PAPER_EPOCHS, PAPER_MODELS
from . import train as train_cli
from ._runs import find_runs, frac, mean_std, time_to_target

__all__ = ["EXPERIMENTS", "PAPER_TABLE2", "METHODS", "DIST_METHODS", "main", "reproduce", "row_stats"]

METHODS = ("sgd", "tengrad", "kfac", "ekfac", "kbfgs")
DIST_METHODS = ("sgd", "tengrad")  # the methods tengrad_fx.cli.train --distributed runs
EXPERIMENTS = {"fmnist": "fashion-mnist", "fashion-mnist": "fashion-mnist", "cifar10": "cifar10",
               "cifar100": "cifar100"}
CPU_SUBSET, CPU_EPOCHS = 6400, 1

# (dataset, model) -> method -> (time s, top test accuracy %) of the paper's Table 2 (V100)
PAPER_TABLE2: dict[tuple[str, str], dict[str, tuple[float, float]]] = {
    (ds, model): dict(zip(METHODS, cells)) for (ds, model), cells in {
        ("fashion-mnist", "3c1f"): ((52, 92.60), (43, 93.15), (188, 92.2), (275, 92.01), (113, 92.12)),
        ("cifar10", "wrn-28-4"): ((1128, 94.01), (1108, 94.10), (2454, 94.50), (2936, 94.10), (1132, 92.70)),
        ("cifar100", "wrn-28-4"): ((1004, 75.79), (1124, 75.20), (2419, 75.60), (2766, 76.07), (1151, 74.35)),
        ("cifar10", "densenet-19"): ((2278, 93.52), (2077, 93.40), (4292, 93.31), (4820, 93.11), (2412, 93.41)),
        ("cifar100", "densenet-19"): ((1909, 72.10), (2002, 73.90), (3542, 74.50), (3788, 74.29), (2292, 73.50)),
        ("cifar10", "mobilenetv2"): ((1350, 92.70), (1841, 92.71), (3221, 92.63), (4304, 92.83), (1728, 91.30)),
        ("cifar100", "mobilenetv2"): ((1370, 72.78), (1406, 72.81), (3152, 72.82), (4687, 72.97), (1695, 72.01)),
    }.items()
}


def build_parser() -> argparse.ArgumentParser:
    called = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    p = argparse.ArgumentParser(
        prog="tengrad-reproduce" if called.startswith("tengrad-reproduce") else "python -m tengrad_fx.cli.reproduce",
        description="Run SGD / TENGraD / K-FAC / EK-FAC / KBFGS with the paper's settings and print the Table-2 "
                    "row beside the paper's (see the module docstring).")
    p.add_argument("experiment", choices=sorted(EXPERIMENTS), help="fmnist (3C1F), cifar10 or cifar100")
    p.add_argument("--model", default=None, help="CIFAR model: wrn-28-4 (default), densenet-19, mobilenetv2")
    p.add_argument("--methods", default=None, help="comma-separated subset of " + ",".join(METHODS)
                   + f" (default: all; {','.join(DIST_METHODS)} with --distributed)")
    p.add_argument("--seeds", type=int, default=1, help="repetitions (seeds 0..N-1); the paper used 5")
    p.add_argument("--epochs", type=int, default=None, help="default: the paper's (10 / 60); 1 on CPU")
    p.add_argument("--subset", type=int, default=None, metavar="N",
                   help=f"train on N images (default: all; {CPU_SUBSET} on CPU)")
    p.add_argument("--test-subset", type=int, default=0, metavar="M", help="test on M images (0 = all)")
    p.add_argument("--full", action="store_true", help="the paper's full protocol even on a CPU")
    p.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda, ...")
    p.add_argument("--out", default=None, help="output folder (default runs/reproduce-<experiment>[-<model>])")
    p.add_argument("--data-dir", default=None, help="where the dataset files are")
    p.add_argument("--threads", type=int, default=2, help="torch threads on CPU (0 = torch's default)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--distributed", action="store_true",
                   help="under torchrun: DDP + DistributedTENGraD / DDP-SGD, the batch is the global one")
    return p


def _runs_of(out: str, method: str, seeds: int) -> list[str]:
    return [os.path.join(out, f"{method}-s{s}") for s in range(seeds)]


def row_stats(run_dirs: Sequence[str], target_acc: float) -> dict[str, Any]:
    """Mean ± std over the finished runs of: top test accuracy (%) over the evaluations,
    training seconds until the first evaluation at that accuracy, and until ``target_acc``
    (runs that never reach it are left out of the time and counted in ``reached``)."""
    runs = find_runs(run_dirs)
    tops, t_tops, t_tgts, totals = [], [], [], []
    for r in runs:
        totals.append(float(r.summary["train_time"]))  # type: ignore[index]
        best = max(r.epochs, key=lambda e: frac(e["test_acc"]))  # type: ignore[arg-type, return-value]
        tops.append(100.0 * frac(best["test_acc"]))  # type: ignore[operator]
        t_tops.append(float(best["train_time"]))
        t = time_to_target(r, target_acc)
        if t is not None:
            t_tgts.append(t)
    return {"n": len(runs), "acc": mean_std(tops), "time_to_top": mean_std(t_tops), "train_time": mean_std(totals),
            "time_to_target": mean_std(t_tgts) if t_tgts else None, "reached": len(t_tgts)}


def _fmt(ms: Optional[tuple[float, float]], digits: int = 1, n: int = 1) -> str:
    if ms is None:
        return "not reached"
    return f"{ms[0]:.{digits}f}" + (f" ± {ms[1]:.{digits}f}" if n > 1 else "")


def _write_curves_csv(path: str, out: str, methods: Sequence[str], seeds: int) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["method", "seed", "epoch", "step", "train_time_s", "train_loss", "test_loss", "test_acc"])
        for method in methods:
            for run in find_runs(_runs_of(out, method, seeds)):
                for e in run.epochs:
                    w.writerow([method, run.get("seed"), e["epoch"], e["step"], e["train_time"], e["train_loss"],
                                e["test_loss"], e["test_acc"]])


def _settings_match(run_dir: str, argv: list[str]) -> bool:
    """A finished run in ``run_dir`` made with the configuration ``argv`` resolves to."""
    try:
        with open(os.path.join(run_dir, "config.json")) as f:
            old = json.load(f)
        with open(os.path.join(run_dir, "summary.json")) as f:
            json.load(f)
    except (OSError, ValueError):
        return False
    new = train_cli.resolve_config(train_cli.build_parser().parse_args(argv))
    keys = ("model", "dataset", "optimizer", "epochs", "batch_size", "lr", "momentum", "weight_decay", "damping",
            "curvature_every", "fisher", "kl_clip", "lr_schedule", "seed", "subset", "test_subset", "device")
    return all(old.get(k) == new.get(k) for k in keys)


def reproduce(argv: Optional[Sequence[str]] = None) -> dict[str, Any]:
    """Run the experiment; returns ``{"rows": {method: row_stats}, "out": ..., "scaled": ...}``."""
    parser = build_parser()
    args = parser.parse_args(argv)
    dataset = EXPERIMENTS[args.experiment]
    model = args.model or PAPER_MODELS[dataset][0]
    if model not in PAPER_MODELS[dataset]:
        parser.error(f"--model: the paper's {dataset} models are {', '.join(PAPER_MODELS[dataset])}, got {model!r}")
    allowed = DIST_METHODS if args.distributed else METHODS
    methods = [m.strip() for m in (args.methods or ",".join(allowed)).split(",") if m.strip()]
    bad = [m for m in methods if m not in allowed]
    if bad or not methods:
        why = " (--distributed: the K-FAC family has no distributed mode)" if args.distributed else ""
        parser.error(f"--methods: {bad} not available{why}; choose from {', '.join(allowed)}")
    if args.seeds < 1:
        parser.error("--seeds must be >= 1")
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    drun = None
    if args.distributed:
        from ._dist import DistRun

        try:
            drun = DistRun(device)
        except ValueError as exc:
            parser.error(str(exc).replace("tengrad_fx.cli.train", "tengrad_fx.cli.reproduce"))
    try:
        return _reproduce(args, dataset, model, methods, device, drun)
    finally:
        if drun is not None and drun.owns_group:
            drun.close()


def _reproduce(args: argparse.Namespace, dataset: str, model: str, methods: list[str], device: str,
               drun: Any) -> dict[str, Any]:
    """The runs (every rank), then the row, files and summary (rank 0 only)."""
    main_rank = drun is None or drun.main
    say = print if main_rank else (lambda *a, **k: None)
    epochs, subset = args.epochs, args.subset
    if device.startswith("cpu") and not args.full and epochs is None and subset is None:
        epochs, subset = CPU_EPOCHS, CPU_SUBSET
    epochs = epochs or PAPER_EPOCHS[dataset]
    scaled = epochs < PAPER_EPOCHS[dataset] or subset is not None or bool(args.test_subset)
    scale_note = (f"SCALED DOWN from the paper's protocol ({PAPER_EPOCHS[dataset]} epochs on the whole training "
                  f"set): {epochs} epoch(s) on {subset if subset is not None else 'all'} training images, tested on "
                  f"{args.test_subset or 'all'} test images" + (" (a CPU run; --full for the paper's)"
                                                                 if device.startswith("cpu") else ""))
    out = args.out or os.path.join("runs", f"reproduce-{args.experiment}" + (f"-{model}" if args.model else ""))
    if main_rank:
        os.makedirs(out, exist_ok=True)
    paper = PAPER_TABLE2[(dataset, model)]
    target = paper["sgd"][1]
    where = f"{drun.world} ranks (--distributed)" if drun is not None else device
    say(f"{model} / {dataset}: {', '.join(methods)} × {args.seeds} seed(s) on {where}, paper settings; "
        f"{scale_note if scaled else 'the paper protocol'}; logs in {out}", flush=True)

    t_start = time.perf_counter()
    for method in methods:
        for seed, run_dir in enumerate(_runs_of(out, method, args.seeds)):
            argv_run = ["--model", model, "--dataset", dataset, "--optimizer", method, "--epochs", str(epochs),
                        "--seed", str(seed), "--device", device, "--out", run_dir, "--test-subset",
                        str(args.test_subset), "--threads", str(args.threads), "--no-plot"]
            argv_run += ["--subset", str(subset)] if subset is not None else []
            argv_run += ["--data-dir", args.data_dir] if args.data_dir else []
            argv_run += ["--no-progress"] if args.no_progress else []
            argv_run += ["--distributed"] if drun is not None else []
            reuse = _settings_match(run_dir, argv_run) if main_rank else None
            if drun is not None:
                reuse = drun.from_main(reuse)  # every rank takes rank 0's decision
            if reuse:
                say(f"[{method} seed {seed}] reusing the finished run in {run_dir}", flush=True)
                continue
            say(f"[{method} seed {seed}] training ...", flush=True)
            train_cli.run(argv_run)
    wall = time.perf_counter() - t_start
    if not main_rank:
        return {"rows": {}, "out": out, "scaled": scaled, "table": "", "summary": "", "device": device,
                "rank": drun.rank}

    rows = {m: row_stats(_runs_of(out, m, args.seeds), target) for m in methods}
    head = (f"{'method':<9} {'top test acc %':>16} {'time to top (s)':>16} {f'time to {target:g}% (s)':>18}"
            f"   | paper: time (s) [top acc %]")
    lines = [f"Table 2 row, {model} / {dataset} ({device}; mean ± std over {args.seeds} seed(s))", head]
    with open(os.path.join(out, "table.csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["method", "seeds", "top_test_acc", "top_test_acc_std", "time_to_top_s", "time_to_target_s",
                    "target_acc", "reached", "paper_time_s", "paper_acc", "scaled", "device"])
        for m, r in rows.items():
            n = r["n"]
            ttt = "not reached" if r["time_to_target"] is None else _fmt(r["time_to_target"], 1, r["reached"])
            if r["time_to_target"] is not None and r["reached"] < n:
                ttt += f" ({r['reached']}/{n})"
            lines.append(f"{m:<9} {_fmt(r['acc'], 2, n):>16} {_fmt(r['time_to_top'], 1, n):>16} {ttt:>18}"
                         f"   | {paper[m][0]:g} [{paper[m][1]:.2f}]")
            w.writerow([m, n, f"{r['acc'][0]:.4f}", f"{r['acc'][1]:.4f}", f"{r['time_to_top'][0]:.2f}",
                        "" if r["time_to_target"] is None else f"{r['time_to_target'][0]:.2f}", target,
                        r["reached"], paper[m][0], paper[m][1], scaled, device])
    if scaled:
        lines.append(scale_note + ": not comparable to the paper's numbers")
    table = "\n".join(lines)
    print("\n" + table, flush=True)
    _write_curves_csv(os.path.join(out, "curves.csv"), out, methods, args.seeds)
    plot_note = "no plot (install matplotlib: pip install -e '.[plot]')"
    try:
        from .plot import plot_runs

        all_runs = [d for m in methods for d in _runs_of(out, m, args.seeds)]
        plot_note = " and ".join(plot_runs(all_runs, os.path.join(out, "curves.png"),
                                           title=f"{model} / {dataset}" + (" (scaled down)" if scaled else "")))
    except ImportError as exc:
        if "matplotlib" not in str(exc):
            raise
    best = max(rows, key=lambda m: rows[m]["acc"][0])
    per_method = "; ".join(f"{m} {rows[m]['acc'][0]:.2f}% top test accuracy (paper {paper[m][1]:.2f}%) after "
                           f"{rows[m]['train_time'][0]:.0f} s of training" for m in methods)
    protocol = (f"scaled down: {epochs} epoch(s) on {subset or 'all'} training images" if scaled
                else "paper protocol")
    summary = (f"Summary: {per_method} ({best} best) on {model} / {dataset}, {protocol}, "
               f"{device}; {wall:.0f} s of wall-clock for this command's training and evaluation. Curves: {plot_note}; "
               f"per-epoch numbers: {os.path.join(out, 'curves.csv')}; the row: {os.path.join(out, 'table.csv')}; "
               f"each run's logs (config.json, steps.jsonl, epochs.jsonl, summary.json, checkpoint.pt) in "
               f"{os.path.join(out, '<method>-s<seed>')}.")
    print("\n" + summary, flush=True)
    return {"rows": rows, "out": out, "scaled": scaled, "table": table, "summary": summary, "device": device}


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Console entry point (``tengrad-reproduce``, ``python -m tengrad_fx.cli.reproduce``)."""
    reproduce(argv)


if __name__ == "__main__":
    main()
