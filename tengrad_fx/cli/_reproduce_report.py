"""What ``tengrad-reproduce`` prints and writes once its runs are done: the Table-2 row beside
the paper's (``table.csv``), every evaluation (``curves.csv``), the curves, and the summary
comparing the methods (final test accuracy, and the steps and training seconds each method
took to reach the lowest final accuracy among them)."""
from __future__ import annotations

import csv
import os
from typing import Any, Optional, Sequence

from ._runs import Run, eval_points, find_runs, frac, mean_std

__all__ = ["compare", "comparison_text", "row_stats", "runs_of", "table_text", "write_curves_csv"]


def runs_of(out: str, method: str, seeds: int) -> list[str]:
    """The run directories of ``method``: ``OUT/<method>-s<seed>``."""
    return [os.path.join(out, f"{method}-s{s}") for s in range(seeds)]


def _summary_value(run: Run, key: str) -> float:
    assert run.summary is not None  # find_runs returns finished runs only
    return float(run.summary[key])


def _pct(rec: dict[str, Any]) -> float:
    """A record's test accuracy in %."""
    return 100.0 * (frac(rec.get("test_acc")) or 0.0)


def _first_at(run: Run, target: float) -> Optional[dict[str, Any]]:
    """The first evaluation of ``run`` with test accuracy ``>= target`` (a fraction or %)."""
    t = frac(target)
    assert t is not None
    for e in eval_points(run):
        acc = frac(e.get("test_acc"))
        if acc is not None and acc >= t - 1e-12:
            return e
    return None


def row_stats(run_dirs: Sequence[str], target_acc: float) -> dict[str, Any]:
    """Mean ± std over the finished runs of: top test accuracy (%) over the evaluations,
    training seconds until the first evaluation at that accuracy, and until ``target_acc``
    (runs that never reach it are left out of the time and counted in ``reached``)."""
    runs = find_runs(run_dirs)
    tops, t_tops, t_tgts, totals = [], [], [], []
    for r in runs:
        totals.append(_summary_value(r, "train_time"))
        best = max(eval_points(r), key=_pct)
        tops.append(_pct(best))
        t_tops.append(float(best["train_time"]))
        hit = _first_at(r, target_acc)
        if hit is not None:
            t_tgts.append(float(hit["train_time"]))
    return {"n": len(runs), "acc": mean_std(tops), "time_to_top": mean_std(t_tops), "train_time": mean_std(totals),
            "time_to_target": mean_std(t_tgts) if t_tgts else None, "reached": len(t_tgts)}


def _fmt(ms: Optional[tuple[float, float]], digits: int = 1, n: int = 1) -> str:
    if ms is None:
        return "not reached"
    return f"{ms[0]:.{digits}f}" + (f" ± {ms[1]:.{digits}f}" if n > 1 else "")


def table_text(path: str, rows: dict[str, dict[str, Any]], paper: dict[str, tuple[float, float]], title: str,
               scaled: bool, device: str) -> str:
    """The Table-2 row beside the paper's, as text; also written to ``path`` (table.csv)."""
    target = paper["sgd"][1]
    head = (f"{'method':<9} {'top test acc %':>16} {'time to top (s)':>16} {f'time to {target:g}% (s)':>18}"
            f"   | paper: time (s) [top acc %]")
    lines = [title, head]
    with open(path, "w", newline="") as f:
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
    return "\n".join(lines)


def write_curves_csv(path: str, out: str, methods: Sequence[str], seeds: int) -> None:
    """One row per method, seed and evaluation (epoch ends and ``--eval-every`` points)."""
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["method", "seed", "epoch", "step", "train_time_s", "train_loss", "test_loss", "test_acc"])
        for method in methods:
            for run in find_runs(runs_of(out, method, seeds)):
                for e in eval_points(run):
                    w.writerow([method, run.get("seed"), e["epoch"], e["step"], e["train_time"], e.get("train_loss"),
                                e["test_loss"], e["test_acc"]])


def compare(out: str, methods: Sequence[str], seeds: int) -> dict[str, Any]:
    """Per method (means over the finished seeds): ``final`` test accuracy (%), ``steps``,
    ``train_time``; ``target``: the lowest final accuracy among the methods; per method
    ``to_target``: ``(steps, seconds, seeds that reached it)`` at its first evaluation at or
    above the target (``None`` when no seed reached it)."""
    per: dict[str, dict[str, Any]] = {}
    for m in methods:
        runs = find_runs(runs_of(out, m, seeds))
        per[m] = {"runs": runs, "final": mean_std([100.0 * (frac(_summary_value(r, "test_acc")) or 0.0)
                                                   for r in runs])[0],
                  "steps": mean_std([_summary_value(r, "steps") for r in runs])[0],
                  "train_time": mean_std([_summary_value(r, "train_time") for r in runs])[0]}
    target = min(p["final"] for p in per.values())
    for p in per.values():
        hits = [h for h in (_first_at(r, target / 100.0) for r in p.pop("runs")) if h is not None]
        p["to_target"] = (mean_std([float(h["step"]) for h in hits])[0],
                          mean_std([float(h["train_time"]) for h in hits])[0], len(hits)) if hits else None
    return {"methods": per, "target": target, "lowest": min(per, key=lambda m: per[m]["final"])}


def comparison_text(cmp: dict[str, Any], paper: dict[str, tuple[float, float]], scaled: bool, seeds: int,
                    paper_epochs: int) -> str:
    """The summary's first sentences: each method's final test accuracy (beside the paper's
    on the paper's protocol), then the steps and seconds each needed to reach the lowest
    final accuracy; on a scaled run the paper's figures follow as context only."""
    per = cmp["methods"]
    finals = ", ".join(f"{m} {p['final']:.2f} %" + ("" if scaled else f" (paper {paper[m][1]:.2f} %)")
                       for m, p in per.items())
    steps = ", ".join(f"{m} {p['steps']:.0f} steps / {p['train_time']:.0f} s" for m, p in per.items())
    text = f"final test accuracy {finals} (training: {steps})."
    if len(per) > 1:
        reach = []
        for m, p in per.items():
            tt = p["to_target"]
            seeds_note = f" ({tt[2]}/{seeds} seeds)" if tt is not None and tt[2] < seeds else ""
            reach.append(f"{m} " + ("not reached" if tt is None else f"step {tt[0]:.0f} / {tt[1]:.0f} s{seeds_note}"))
        text += f" To reach {cmp['target']:.2f} % ({cmp['lowest']}'s final): {', '.join(reach)} of training."
    if scaled:
        context = ", ".join(f"{m} {paper[m][1]:.2f} % in {paper[m][0]:g} s" for m in per)
        text += (f" For context only (a different, full-length run): the paper's Table 2, {paper_epochs} epochs on all "
                 f"training images on a V100: {context}.")
    return text
