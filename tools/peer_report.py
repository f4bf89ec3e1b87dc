"""The outputs of ``tools.peer_bench``: ``results.json``, ``curves.csv``, ``summary.csv``,
``curves.png`` and the printed table (the race itself is in :mod:`tools.peer_bench`)."""
from __future__ import annotations

import csv
import json
import os
from typing import Any

from tools.peer_methods import PEER_PACKAGE, verdict_lines

__all__ = ["CURVE_COLUMNS", "plot_curves", "report", "write_outputs"]

CURVE_COLUMNS = ["method", "lr", "step", "seconds", "est_seconds", "test_acc", "test_loss"]


def write_outputs(res: dict[str, Any], out: str, plot: bool) -> None:
    """``results.json``, ``curves.csv``, ``summary.csv`` (and ``curves.png``) under ``out``."""
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(res, f, indent=2)
    with open(os.path.join(out, "curves.csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(CURVE_COLUMNS)
        for run in res["runs"]:
            for c in run["curve"]:
                w.writerow([run["method"], run["lr"], *(c[k] for k in CURVE_COLUMNS[2:])])
    targets = list(next(iter(res["summary"].values()))["targets"]) if res["summary"] else []
    cols = ["lr_won", "lr_default", "ratio_to_sgd", "final_acc", "final_loss", "seconds", "diverged_at",
            "peak_memory_mb"]
    with open(os.path.join(out, "summary.csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["method", *cols] + [f"{k}_{t}" for t in targets for k in ("steps", "seconds", "est_seconds")])
        for m, s in res["summary"].items():
            hits = [(s["targets"][t] or {}).get(k) for t in targets for k in ("steps", "seconds", "est_seconds")]
            w.writerow([m, *(s.get(c) for c in cols), *hits])
    if plot:
        plot_curves(res, os.path.join(out, "curves.png"))


def plot_curves(res: dict[str, Any], path: str) -> None:
    """The raced metric (test accuracy, or validation loss) of every method's winning run
    against steps and estimated seconds, and the other one (loss, or next-byte accuracy)
    against steps."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install 'tengrad-fx[plot]')")
        return
    metric = res["config"].get("metric", "test_acc")
    lm = metric == "test_loss"
    label_y, other, label_o = ("validation loss (nats/byte)", "test_acc", "next-byte accuracy") if lm else \
        ("test accuracy", "test_loss", "test loss")
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    won = {(s["method"], s["lr"]) for s in res["summary"].values()}
    for run in res["runs"]:
        if (run["method"], run["lr"]) not in won:
            continue
        c = run["curve"]
        label = f"{run['method']} (lr {run['lr']:.3g})"
        axes[0].plot([p["step"] for p in c], [p[metric] for p in c], label=label)
        axes[1].plot([p["est_seconds"] for p in c], [p[metric] for p in c], label=label)
        axes[2].plot([p["step"] for p in c], [p[other] for p in c], label=label)
    for ax, (xl, yl) in zip(axes, [("step", label_y), ("estimated seconds", label_y), ("step", label_o)]):
        ax.set_xlabel(xl)
        ax.set_ylabel(yl)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def report(res: dict[str, Any]) -> str:
    """The summary table: per method the winning lr, steps and seconds to each target, final
    accuracy (or validation loss), the step cost as a multiple of SGD's and (CUDA) peak memory."""
    cfg = res["config"]
    final = "final_loss" if cfg.get("metric") == "test_loss" else "final_acc"
    lines = [f"model={cfg['model']} batch={cfg['batch_size']} steps={cfg['steps']} device={cfg['device']} "
             f"threads={cfg['threads']} torch={cfg['torch']} {PEER_PACKAGE}={cfg['versions'].get(PEER_PACKAGE)} "
             f"SGD step {cfg['sgd_step_seconds'] * 1e3:.1f} ms"]
    targets = list(next(iter(res["summary"].values()))["targets"]) if res["summary"] else []
    head = f"{'method':<16}{'lr':>9}{'x SGD':>8}{final.replace('_', ' '):>11}{'seconds':>9}{'peak MB':>9}"
    lines.append(head + "".join(f"{'steps@' + t:>11}{'est s@' + t:>11}" for t in targets))
    for m, s in res["summary"].items():
        mem = "-" if s.get("peak_memory_mb") is None else f"{s['peak_memory_mb']:.0f}"
        row = f"{m:<16}{s['lr_won']:>9.3g}{s['ratio_to_sgd']:>8.2f}{s[final]:>11.4f}{s['seconds']:>9.1f}{mem:>9}"
        for t in targets:
            hit = s["targets"][t]
            row += f"{'-':>11}{'-':>11}" if hit is None else f"{hit['steps']:>11d}{hit['est_seconds']:>11.1f}"
        lines.append(row + (f"  diverged at {s['diverged_at']}" if s["diverged_at"] else ""))
    return "\n".join(lines + verdict_lines(res.get("verdict")))
