"""Training curves of ``tengrad_fx.cli.train`` runs: the paper's Figs. 1, 3, 4 with error bands.

    python -m tengrad_fx.cli.plot RUN_DIR... --out PATH.png [--group-by optimizer] [--title T] [--x step]

A ``RUN_DIR`` is one run directory or any folder holding several (e.g. a sweep
directory). The figure is 2×2: training loss (top) and test accuracy (bottom) against
epochs (left; ``--x step``: optimizer steps) and against wall-clock *training* time (right;
evaluation excluded). Test accuracy is drawn at every evaluation: the epoch ends and, for
runs trained with ``--eval-every``, the evaluations between them.
Runs are grouped by the ``--group-by`` config keys (comma-separated; default
``optimizer``; ``config`` = every config key except the seed and bookkeeping keys, see
``tengrad_fx.cli._runs.IGNORED_KEYS``). Each group is drawn as the mean over its runs (seeds) with
a ± one-standard-deviation band (sample std); on the time axis a point sits at the seeds'
mean training time of that epoch/step. PNG and SVG are written with the same stem.

Training loss comes from ``epochs.jsonl`` (``train_loss``) when every run has at least
two epochs (and the x axis is epochs), else from ``steps.jsonl`` (per-step loss, plotted at
fractional epochs or at its step).
"""
from __future__ import annotations

import argparse
import os
from typing import Optional, Sequence

from ..utils.optional import require

require("matplotlib", "plot", "tengrad_fx.cli.plot (the training curves)").use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from ._runs import Run, band, eval_points, find_runs, frac, group_runs  # noqa: E402

__all__ = ["plot_runs", "run_curves", "output_paths", "save_figure", "main"]


def save_figure(fig: "plt.Figure", out_path: str) -> list[str]:
    """Write ``fig`` as PNG and SVG (paths from :func:`output_paths`), close it, return the paths."""
    paths = output_paths(out_path)
    for p in paths:
        os.makedirs(os.path.dirname(os.path.abspath(p)), exist_ok=True)
        fig.savefig(p, dpi=150)
    plt.close(fig)
    return paths


def output_paths(out_path: str) -> list[str]:
    """``[stem.png, stem.svg]`` for ``out_path`` (its suffix, if .png/.svg/.pdf, dropped)."""
    stem, ext = os.path.splitext(out_path)
    if ext.lower() not in (".png", ".svg", ".pdf"):
        stem = out_path
    return [stem + ".png", stem + ".svg"]


def _step_curve(run: Run, x: str = "epoch") -> tuple[list[float], list[float], list[float]]:
    """Per-step training loss: ``(epoch_x, time_x, loss)`` at fractional epochs, or
    ``(step_x, time_x, loss)`` for ``x="step"``."""
    by_epoch: dict[object, list[dict]] = {}
    for s in run.steps:
        if s.get("loss") is None:
            continue
        by_epoch.setdefault(s.get("epoch", 0), []).append(s)
    ex, tx, ys = [], [], []
    for k, (_, recs) in enumerate(by_epoch.items()):
        n = len(recs)
        for j, s in enumerate(recs):
            ex.append(float(s["step"]) if x == "step" else k + (j + 1) / n)
            tx.append(float(s.get("train_time", float("nan"))))
            ys.append(float(s["loss"]))
    return ex, tx, ys


def run_curves(run: Run, loss_from: str = "epochs",
               x: str = "epoch") -> dict[str, tuple[list[float], list[float], list[float]]]:
    """``{"loss": (epoch_x, time_x, y), "acc": (epoch_x, time_x, y %)}`` of one run; with
    ``x="step"`` the first axis is the optimizer step (and the loss the per-step one)."""
    if loss_from == "steps" or x == "step":
        loss = _step_curve(run, x)
    else:
        es = [e for e in run.epochs if e.get("train_loss") is not None]
        loss = ([float(e["epoch"]) for e in es], [float(e["train_time"]) for e in es],
                [float(e["train_loss"]) for e in es])
    ea = [e for e in eval_points(run) if e.get("test_acc") is not None]
    acc = ([float(e[x]) for e in ea], [float(e["train_time"]) for e in ea],
           [100.0 * frac(e["test_acc"]) for e in ea])  # type: ignore[operator]
    return {"loss": loss, "acc": acc}


def _label(key: tuple, n: int) -> str:
    if len(key) == 1:
        text = str(key[0][1])
    else:
        text = " ".join(f"{k}={v}" for k, v in key if v is not None)
    return f"{text} (n={n})" if n > 1 else text


def plot_runs(run_dirs: list[str], out_path: str, group_by: Optional[Sequence[str]] = ("optimizer",),
              title: Optional[str] = None, loss_from: str = "auto", x: str = "epoch") -> list[str]:
    """Draw the 2×2 figure for the finished runs at or below ``run_dirs``.

    Args:
        run_dirs: run directories, or folders holding them.
        out_path: output path; PNG and SVG are written with its stem.
        group_by: config keys whose values define a curve (mean ± std over the rest,
            i.e. over seeds); ``None`` = every config key but the seed/bookkeeping ones.
        title: figure title (default: model / dataset of the runs).
        loss_from: ``"epochs"``, ``"steps"`` or ``"auto"`` (see module docstring).
        x: the left column's axis, ``"epoch"`` or ``"step"``.

    Returns:
        The written paths ``[png, svg]``.
    """
    runs = find_runs(run_dirs)
    if not runs:
        raise FileNotFoundError(f"no finished run (a directory with config.json and summary.json) in {run_dirs}")
    if x not in ("epoch", "step"):
        raise ValueError(f"x: 'epoch' or 'step', got {x!r}")
    if loss_from == "auto":
        loss_from = "epochs" if x == "epoch" and all(
            sum(e.get("train_loss") is not None for e in r.epochs) >= 2 for r in runs) else "steps"
    if x == "step":
        loss_from = "steps"
    groups = group_runs(runs, group_by)

    fig, axes = plt.subplots(2, 2, figsize=(11, 8), constrained_layout=True)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for gi, (key, members) in enumerate(groups.items()):
        color = colors[gi % len(colors)]
        curves = [run_curves(r, loss_from, x) for r in members]
        label = _label(key, len(members))
        for row, metric in enumerate(("loss", "acc")):
            for col, xi in enumerate((0, 1)):  # epoch axis, time axis
                xs = [c[metric][xi] for c in curves]
                ys = [c[metric][2] for c in curves]
                xv, mu, sd = band(xs, ys)
                if not xv:
                    continue
                ax = axes[row, col]
                marker = "o" if len(xv) <= 20 else None
                ax.plot(xv, mu, color=color, label=label, marker=marker, markersize=3)
                if len(members) > 1:
                    lo = [m - s for m, s in zip(mu, sd)]
                    hi = [m + s for m, s in zip(mu, sd)]
                    ax.fill_between(xv, lo, hi, color=color, alpha=0.2, linewidth=0)
    loss_name = "training loss" + (" (per step)" if loss_from == "steps" else "")
    for col, xlabel in enumerate(("optimizer step" if x == "step" else "epoch", "training time (s)")):
        axes[0, col].set_ylabel(loss_name)
        axes[1, col].set_ylabel("test accuracy (%)")
        for row in range(2):
            axes[row, col].set_xlabel(xlabel)
            axes[row, col].grid(True, alpha=0.3)
    for ax in axes[0]:
        if all(v > 0 for line in ax.get_lines() for v in line.get_ydata()) and ax.get_lines():
            ax.set_yscale("log")
    axes[1, 1].legend(loc="lower right", fontsize=8)
    if title is None:
        md = sorted({f"{r.get('model', '?')} / {r.get('dataset', '?')}" for r in runs})
        title = ", ".join(md)
    several = any(len(members) > 1 for members in groups.values())
    fig.suptitle(title + ("  — mean ± std over seeds" if several else ""))
    return save_figure(fig, out_path)


def main(argv: Optional[Sequence[str]] = None) -> list[str]:
    ap = argparse.ArgumentParser(prog="python -m tengrad_fx.cli.plot", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories or folders of them")
    ap.add_argument("--out", required=True, help="output path (.png); an .svg with the same stem is written too")
    ap.add_argument("--group-by", default="optimizer",
                    help="comma-separated config keys defining a curve; 'config' = all but seed (default: optimizer)")
    ap.add_argument("--title", default=None)
    ap.add_argument("--loss-from", choices=("auto", "epochs", "steps"), default="auto")
    ap.add_argument("--x", choices=("epoch", "step"), default="epoch", help="the left column's axis")
    a = ap.parse_args(argv)
    group_by = None if a.group_by.strip() == "config" else [k.strip() for k in a.group_by.split(",") if k.strip()]
    paths = plot_runs(a.run_dirs, a.out, group_by=group_by, title=a.title, loss_from=a.loss_from, x=a.x)
    for p in paths:
        print(p)
    return paths


if __name__ == "__main__":
    main()
