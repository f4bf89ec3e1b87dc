"""Hyperparameter sensitivity (paper appendix): train / test accuracy over (lr, damping).

    python -m tools.sensitivity SWEEP_DIR --out PATH.png [--optimizer tengrad] [--weight-decay WD]

Reads ``SWEEP_DIR/results.csv`` (regenerated from the run directories by
``tools.sweep.write_results`` when missing) and draws two heatmaps side by side —
final training accuracy and test accuracy (%), rows = learning rate, columns = damping —
each cell the mean over seeds, annotated. With several weight-decay values in the sweep
a cell shows the weight decay with the best mean test accuracy at that (lr, damping)
(its value is printed in the cell), unless ``--weight-decay`` fixes one. Cells without a
finished run stay blank. PNG and SVG are written with the same stem.
"""
from __future__ import annotations

import argparse
import math
import os
from typing import Any, Optional, Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

from tengrad_fx.cli._runs import mean_std
from tengrad_fx.cli.plot import save_figure
from tools.sweep import read_results, write_results

__all__ = ["sensitivity_grid", "plot_sensitivity", "main"]


def _close(a: Optional[float], b: Optional[float]) -> bool:
    if a is None or b is None:
        return a is b
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-15)


def sensitivity_grid(rows: Sequence[dict[str, Any]], optimizer: Optional[str] = None,
                     weight_decay: Optional[float] = None) -> dict[str, Any]:
    """Pivot ``results.csv`` rows into ``lrs``, ``dampings`` and ``[len(lrs), len(dampings)]``
    arrays ``train`` / ``test`` (mean %, NaN where no run), ``wd`` (weight decay shown) and
    ``n`` (seeds per cell)."""
    opts = sorted({r["optimizer"] for r in rows if r.get("optimizer")})
    if optimizer is None:
        damped = [o for o in opts if any(r.get("damping") is not None for r in rows if r["optimizer"] == o)]
        if len(damped) != 1:
            raise ValueError(f"pass --optimizer (the results hold {', '.join(opts) or 'no runs'})")
        optimizer = damped[0]
    sel = [r for r in rows if r["optimizer"] == optimizer and r.get("damping") is not None]
    if weight_decay is not None:
        sel = [r for r in sel if _close(r.get("weight_decay"), weight_decay)]
    if not sel:
        raise ValueError(f"no finished {optimizer} runs with a damping value"
                         + (f" and weight decay {weight_decay:g}" if weight_decay is not None else ""))
    lrs = sorted({float(r["lr"]) for r in sel})
    dampings = sorted({float(r["damping"]) for r in sel})
    shape = (len(lrs), len(dampings))
    train, test, wds, ns = np.full(shape, np.nan), np.full(shape, np.nan), np.full(shape, np.nan), np.zeros(shape, int)
    for i, lr in enumerate(lrs):
        for j, d in enumerate(dampings):
            cell = [r for r in sel if _close(r["lr"], lr) and _close(r["damping"], d)]
            best = None
            for wd in sorted({r["weight_decay"] for r in cell}):
                members = [r for r in cell if _close(r["weight_decay"], wd)]
                te = mean_std([100.0 * r["test_acc"] for r in members if r.get("test_acc") is not None])[0]
                tr = mean_std([100.0 * r["train_acc"] for r in members if r.get("train_acc") is not None])[0]
                if best is None or (te > best[0]) or math.isnan(best[0]):
                    best = (te, tr, wd, len(members))
            if best is not None:
                test[i, j], train[i, j], wds[i, j], ns[i, j] = best
    return {"optimizer": optimizer, "lrs": lrs, "dampings": dampings, "train": train, "test": test, "wd": wds, "n": ns}


def plot_sensitivity(grid: dict[str, Any], out_path: str, title: Optional[str] = None) -> list[str]:
    """Two annotated heatmaps (train, test accuracy); returns ``[png, svg]``."""
    several_wd = len({float(w) for w in grid["wd"].flatten() if not np.isnan(w)}) > 1
    nl, nd = len(grid["lrs"]), len(grid["dampings"])
    fig, axes = plt.subplots(1, 2, figsize=(max(8.0, 2.2 + 1.6 * nd) * 2 / 1.4, max(3.5, 1.0 + 0.6 * nl)),
                             constrained_layout=True)
    finite = np.concatenate([grid[k][~np.isnan(grid[k])] for k in ("train", "test")])
    vmin, vmax = (float(finite.min()), float(finite.max())) if finite.size else (0.0, 100.0)
    if vmax - vmin < 1e-9:
        vmin, vmax = vmin - 1.0, vmax + 1.0
    im = None
    for ax, key, name in zip(axes, ("train", "test"), ("training accuracy (%)", "test accuracy (%)")):
        data = np.ma.masked_invalid(grid[key])
        im = ax.imshow(data, cmap="viridis", vmin=vmin, vmax=vmax, aspect="auto", origin="lower")
        ax.set_xticks(range(nd), [f"{d:g}" for d in grid["dampings"]])
        ax.set_yticks(range(nl), [f"{lr:g}" for lr in grid["lrs"]])
        ax.set_xlabel("damping")
        ax.set_ylabel("learning rate")
        ax.set_title(name)
        for i in range(nl):
            for j in range(nd):
                v = grid[key][i, j]
                if np.isnan(v):
                    continue
                text = f"{v:.1f}" + (f"\nwd {grid['wd'][i, j]:g}" if several_wd else "")
                shade = (v - vmin) / (vmax - vmin)
                ax.text(j, i, text, ha="center", va="center", fontsize=7,
                        color="black" if shade > 0.6 else "white")
    fig.colorbar(im, ax=axes, shrink=0.9, label="accuracy (%)")
    fig.suptitle(title or f"{grid['optimizer']}: sensitivity to learning rate and damping (mean over seeds)")
    return save_figure(fig, out_path)


def main(argv: Optional[Sequence[str]] = None) -> list[str]:
    ap = argparse.ArgumentParser(prog="python -m tools.sensitivity", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("sweep_dir", metavar="SWEEP_DIR")
    ap.add_argument("--out", required=True, help="output .png (an .svg with the same stem is written too)")
    ap.add_argument("--optimizer", default=None, help="which method (needed if the sweep holds several)")
    ap.add_argument("--weight-decay", type=float, default=None, help="fix the weight decay (default: best per cell)")
    ap.add_argument("--title", default=None)
    a = ap.parse_args(argv)
    csv_path = os.path.join(a.sweep_dir, "results.csv")
    if not os.path.exists(csv_path):
        write_results(a.sweep_dir)
    grid = sensitivity_grid(read_results(csv_path), a.optimizer, a.weight_decay)
    paths = plot_sensitivity(grid, a.out, a.title)
    for p in paths:
        print(p)
    return paths


if __name__ == "__main__":
    main()
