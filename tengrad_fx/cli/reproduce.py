"""Reproduce a row of the paper's Table 2 with one command.

    tengrad-reproduce fmnist                        # SGD, TENGraD, K-FAC, EK-FAC, KBFGS on 3C1F
    tengrad-reproduce fmnist --methods tengrad,sgd  # the README's main command
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

Output: the Table-2 row beside the paper's (top test accuracy over the evaluations,
training seconds until that evaluation, training seconds until the paper's SGD accuracy,
mean ± std over seeds), ``OUT/curves.png`` / ``.svg`` (loss and test accuracy vs epoch, or
vs step when evaluating every ``--eval-every`` steps, and vs training seconds,
:func:`tengrad_fx.cli.plot.plot_runs`), ``OUT/curves.csv`` (one row per method, seed and
evaluation), ``OUT/table.csv`` (the row) and a summary comparing the methods: each one's
final test accuracy and the steps and training seconds each took to reach the lowest of
them (:mod:`tengrad_fx.cli._reproduce_report`).

``--distributed`` (under ``torchrun``, like ``tengrad_fx.cli.train --distributed``): every run is a
``tengrad_fx.cli.train --distributed`` run of this process group — DDP + ``DistributedTENGraD``
(global-batch Fisher) or DDP-SGD; the batch 128 is the global one (a multiple of the
world size), each rank trains on its block of it; only rank 0 prints and writes (the
table, CSVs, plot; the runs' logs and checkpoints); rank 0 decides which finished runs
are reused and tells the others. Methods: ``sgd`` and ``tengrad`` (the default then;
the K-FAC family has no distributed mode)::

    torchrun --nproc_per_node=8 -m tengrad_fx.cli.reproduce cifar10 --distributed --data-dir ~/data

``--device`` defaults to CUDA when available. On a CPU the full protocol takes hours, so
unless ``--full``, ``--epochs`` or ``--subset`` is given a CPU run is scaled down: one
epoch on a fixed 19,200-image training subset (150 steps of batch 128; every method sees
the same images in the same order from the same initial weights: one seed, one data
generator), the test accuracy on a fixed 1,000-image test subset every 15 steps (10
points per method); the output says so, and names the paper's figures as context only.
``--epochs`` / ``--subset`` / ``--test-subset`` / ``--eval-every`` set the scale
explicitly on any device.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from ..optim.registry import PAPER_EPOCHS, PAPER_MODELS
from ..utils.memory import steady_malloc
from . import train as train_cli
from ._reproduce_report import compare, comparison_text, row_stats, runs_of, table_text, write_curves_csv

__all__ = ["EXPERIMENTS", "PAPER_TABLE2", "METHODS", "DIST_METHODS", "Scale", "main", "reproduce", "row_stats"]

METHODS = ("sgd", "tengrad", "kfac", "ekfac", "kbfgs")
DIST_METHODS = ("sgd", "tengrad")  # the methods tengrad_fx.cli.train --distributed runs
EXPERIMENTS = {"fmnist": "fashion-mnist", "fashion-mnist": "fashion-mnist", "cifar10": "cifar10",
               "cifar100": "cifar100"}
BATCH = 128  # the paper's, tengrad_fx.cli.train's default
# A CPU run: one epoch on CPU_SUBSET training images, CPU_EVAL_POINTS evaluations on CPU_TEST_SUBSET test images.
CPU_SUBSET, CPU_EPOCHS, CPU_TEST_SUBSET, CPU_EVAL_POINTS = 150 * BATCH, 1, 1000, 10

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
    p.add_argument("--epochs", type=int, default=None, help=f"default: the paper's (10 / 60); {CPU_EPOCHS} on CPU")
    p.add_argument("--subset", type=int, default=None, metavar="N",
                   help=f"train on N images (default: all; {CPU_SUBSET} on CPU)")
    p.add_argument("--test-subset", type=int, default=None, metavar="M",
                   help=f"test on M images (0 = all; default: all, {CPU_TEST_SUBSET} on CPU)")
    p.add_argument("--eval-every", type=int, default=None, metavar="STEPS",
                   help="also evaluate every STEPS steps (0 = at epoch ends only; default: 0, "
                        f"{CPU_EVAL_POINTS} points on CPU)")
    p.add_argument("--full", action="store_true", help="the paper's full protocol even on a CPU")
    p.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda, ...")
    p.add_argument("--out", default=None, help="output folder (default runs/reproduce-<experiment>[-<model>])")
    p.add_argument("--data-dir", default=None, help="where the dataset files are")
    p.add_argument("--threads", type=int, default=2, help="torch threads on CPU (0 = torch's default)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--distributed", action="store_true",
                   help="under torchrun: DDP + DistributedTENGraD / DDP-SGD, the batch is the global one")
    return p


@dataclass(frozen=True)
class Scale:
    """How much of the paper's protocol a reproduction runs.

    ``epochs``; ``subset``: training images (None = all); ``test_subset``: test images (0 =
    all); ``eval_every``: steps between evaluations (0 = at epoch ends only); ``cpu``: the
    CPU default scale; ``paper_epochs``: the paper's epochs for the dataset."""

    epochs: int
    subset: Optional[int]
    test_subset: int
    eval_every: int
    cpu: bool
    paper_epochs: int

    @property
    def scaled(self) -> bool:
        """Anything less than the paper's protocol."""
        return self.epochs < self.paper_epochs or self.subset is not None or bool(self.test_subset)

    def note(self, device: str) -> str:
        return (f"SCALED DOWN from the paper's protocol ({self.paper_epochs} epochs on the whole training set): "
                f"{self.epochs} epoch(s) on {self.subset if self.subset is not None else 'all'} training images, "
                f"tested on {self.test_subset or 'all'} test images"
                + (f" every {self.eval_every} steps" if self.eval_every else "")
                + (" (a CPU run; --full for the paper's)" if device.startswith("cpu") else ""))


def resolve_scale(args: argparse.Namespace, dataset: str, device: str) -> Scale:
    """The scale of ``args`` on ``device``: the paper's, the CPU default (a CPU without
    ``--full`` / ``--epochs`` / ``--subset``), or as given."""
    cpu = device.startswith("cpu") and not args.full and args.epochs is None and args.subset is None
    subset = CPU_SUBSET if cpu else args.subset
    epochs = CPU_EPOCHS if cpu else (args.epochs or PAPER_EPOCHS[dataset])
    test_subset = args.test_subset if args.test_subset is not None else (CPU_TEST_SUBSET if cpu else 0)
    eval_every = args.eval_every if args.eval_every is not None else \
        (max(1, (subset or BATCH) // BATCH // CPU_EVAL_POINTS) if cpu else 0)
    return Scale(epochs, subset, test_subset, eval_every, cpu, PAPER_EPOCHS[dataset])


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
            "curvature_every", "fisher", "kl_clip", "lr_schedule", "seed", "subset", "test_subset", "device",
            "eval_every")
    return all(old.get(k) == new.get(k) for k in keys)


def reproduce(argv: Optional[Sequence[str]] = None) -> dict[str, Any]:
    """Run the experiment; returns ``{"rows": {method: row_stats}, "out": ..., "scaled": ...,
    "table": ..., "summary": ..., "comparison": tengrad_fx.cli._reproduce_report.compare(...), "device": ...}``."""
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
    if args.eval_every is not None and args.eval_every < 0:
        parser.error(f"--eval-every must be >= 0, got {args.eval_every}")
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    if device.startswith("cpu"):
        steady_malloc()  # a CPU step reuses the heap the last one freed (no page faults per step)
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


def _run_argv(args: argparse.Namespace, scale: Scale, model: str, dataset: str, method: str, seed: int,
              device: str, run_dir: str, distributed: bool) -> list[str]:
    """The ``tengrad_fx.cli.train`` arguments of one (method, seed) run."""
    argv = ["--model", model, "--dataset", dataset, "--optimizer", method, "--epochs", str(scale.epochs),
            "--seed", str(seed), "--device", device, "--out", run_dir, "--test-subset", str(scale.test_subset),
            "--threads", str(args.threads), "--no-plot"]
    argv += ["--subset", str(scale.subset)] if scale.subset is not None else []
    argv += ["--eval-every", str(scale.eval_every)] if scale.eval_every else []
    argv += ["--data-dir", args.data_dir] if args.data_dir else []
    argv += ["--no-progress"] if args.no_progress else []
    argv += ["--distributed"] if distributed else []
    return argv


def _reproduce(args: argparse.Namespace, dataset: str, model: str, methods: list[str], device: str,
               drun: Any) -> dict[str, Any]:
    """The runs (every rank), then the row, files and summary (rank 0 only)."""
    main_rank = drun is None or drun.main
    say = print if main_rank else (lambda *a, **k: None)
    scale = resolve_scale(args, dataset, device)
    out = args.out or os.path.join("runs", f"reproduce-{args.experiment}" + (f"-{model}" if args.model else ""))
    if main_rank:
        os.makedirs(out, exist_ok=True)
    where = f"{drun.world} ranks (--distributed)" if drun is not None else device
    say(f"{model} / {dataset}: {', '.join(methods)} × {args.seeds} seed(s) on {where}, paper settings; "
        f"{scale.note(device) if scale.scaled else 'the paper protocol'}; logs in {out}", flush=True)
    t_start = time.perf_counter()
    for method in methods:
        for seed, run_dir in enumerate(runs_of(out, method, args.seeds)):
            argv_run = _run_argv(args, scale, model, dataset, method, seed, device, run_dir, drun is not None)
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
        return {"rows": {}, "out": out, "scaled": scale.scaled, "table": "", "summary": "", "device": device,
                "rank": drun.rank}
    return _report(args, out, dataset, model, methods, device, scale, wall)


def _report(args: argparse.Namespace, out: str, dataset: str, model: str, methods: list[str], device: str,
            scale: Scale, wall: float) -> dict[str, Any]:
    """Print and write the row, the CSVs, the curves and the summary (rank 0)."""
    paper = PAPER_TABLE2[(dataset, model)]
    rows = {m: row_stats(runs_of(out, m, args.seeds), paper["sgd"][1]) for m in methods}
    title = f"Table 2 row, {model} / {dataset} ({device}; mean ± std over {args.seeds} seed(s))"
    table = table_text(os.path.join(out, "table.csv"), rows, paper, title, scale.scaled, device)
    if scale.scaled:
        table += "\n" + scale.note(device) + ": not comparable to the paper's numbers"
    print("\n" + table, flush=True)
    write_curves_csv(os.path.join(out, "curves.csv"), out, methods, args.seeds)
    plot_note = "no plot (install matplotlib: pip install -e '.[plot]')"
    try:
        from .plot import plot_runs

        all_runs = [d for m in methods for d in runs_of(out, m, args.seeds)]
        plot_note = " and ".join(plot_runs(all_runs, os.path.join(out, "curves.png"), title=_plot_title(
            model, dataset, scale), x="step" if scale.eval_every else "epoch"))
    except ImportError as exc:
        if "matplotlib" not in str(exc):
            raise
    cmp = compare(out, methods, args.seeds)
    protocol = (f"scaled down: {scale.epochs} epoch(s) on {scale.subset or 'all'} training images, tested on "
                f"{scale.test_subset or 'all'} test images" if scale.scaled else "paper protocol")
    summary = (f"Summary: {model} / {dataset} ({protocol}; {device}): "
               f"{comparison_text(cmp, paper, scale.scaled, args.seeds, scale.paper_epochs)} "
               f"{wall:.0f} s of wall-clock for this command's training and evaluation. Curves: {plot_note}; "
               f"per-evaluation numbers: {os.path.join(out, 'curves.csv')}; the row: {os.path.join(out, 'table.csv')}; "
               f"each run's logs (config.json, steps.jsonl, epochs.jsonl, summary.json, checkpoint.pt) in "
               f"{os.path.join(out, '<method>-s<seed>')}.")
    print("\n" + summary, flush=True)
    return {"rows": rows, "out": out, "scaled": scale.scaled, "table": table, "summary": summary,
            "comparison": cmp, "device": device}


def _plot_title(model: str, dataset: str, scale: Scale) -> str:
    if not scale.scaled:
        return f"{model} / {dataset}"
    train = f"{scale.subset:,} training images" if scale.subset is not None else "all training images"
    test = f"{scale.test_subset:,} fixed test images" if scale.test_subset else "the whole test set"
    return f"{model} / {dataset}\nscaled down: {scale.epochs} epoch(s) on {train}, tested on {test}"


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Console entry point (``tengrad-reproduce``, ``python -m tengrad_fx.cli.reproduce``)."""
    reproduce(argv)
    from ._dist import leave_if_destroyed
    leave_if_destroyed()  # a torchrun rank: see its docstring


if __name__ == "__main__":
    main()
