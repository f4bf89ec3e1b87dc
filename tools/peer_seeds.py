"""Several seeds of ``tools.peer_bench`` as one table: mean ± spread per method, and the verdict.

    python -m tools.peer_seeds OUT_SEED0 OUT_SEED1 OUT_SEED2 [--targets 0.85,0.88] [--out table.md]

Each argument is a ``--out`` directory (or its ``results.json``) of one ``tools.peer_bench``
run, all with the same model and methods and one seed each. Per method, over the
runs (``n`` seeds):

* ``cost``: the mean of the runs' ``ratio_to_sgd`` (each an interleaved ratio measured in
  its own run);
* ``steps to T``: mean ± half the min–max range of the steps to target accuracy ``T`` (the
  first evaluation at or above it; ``--targets``, default the runs' own) over the seeds that
  reached it, with ``(k of n)`` when only ``k`` did;
* ``time to T``: mean steps × mean cost, in SGD steps; only where every seed reached ``T``
  (a method that misses a target on one seed has no time to it);
* ``acc.``: mean ± half the range of the final test accuracy;
* ``peak MB`` (CUDA runs only): the mean of the runs' ``peak_memory_mb``.

Language models (``config["metric"] == "test_loss"`` in ``results.json``): the targets are
validation losses in nats per byte, reached at or below them (the first evaluation of
``loss_at``), and the last column is the mean ± half the range of the final validation loss.

The verdict: per target, the TENGraD method (``family == "tengrad"`` in ``results.json``)
with the least time against the rival (AdamW and the peers) with the least, and their ratio
(TENGraD's time over the rival's); then the best mean final accuracy (language models: the
lowest mean final loss) of each family. It is
printed under the table and written as JSON with ``--json``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
from typing import Any

from tools.peer_methods import METHODS
from tools.peer_methods import family as peer_family
from tools.peer_methods import verdict as peer_verdict
from tools.peer_methods import verdict_lines as peer_verdict_lines


def load(path: str) -> dict[str, Any]:
    """The ``results.json`` of a ``tools.peer_bench`` output directory (or the file itself)."""
    file = os.path.join(path, "results.json") if os.path.isdir(path) else path
    with open(file) as f:
        return json.load(f)


def _family(method: str, row: dict[str, Any]) -> str:
    """The row's ``family``; for results written before it was stored, ``tools.peer_methods.family``
    of the registered method of that name (a ``--tengrad`` variant's name says nothing)."""
    if "family" in row:
        return str(row["family"])
    if method not in METHODS:
        raise ValueError(f"peer_seeds: method {method!r} has no 'family' in its results.json (written before "
                         "tools.peer_bench stored it) and is no registered method: rerun it with tools.peer_bench")
    return peer_family(METHODS[method])


def _spread(xs: list[float]) -> tuple[float, float]:
    """(mean, half the min–max range) of ``xs``."""
    return statistics.fmean(xs), (max(xs) - min(xs)) / 2


def metric_of(res: dict[str, Any]) -> str:
    """The metric the run's targets are on: ``"test_acc"`` (also for results without it) or ``"test_loss"``."""
    return str(res.get("config", {}).get("metric", "test_acc"))


def steps_to(row: dict[str, Any], target: str, metric: str = "test_acc") -> int | None:
    """Steps of ``row`` (a method's summary) to ``target``: the first evaluation with test
    accuracy (``acc_at``) at or above it, or (``metric`` ``"test_loss"``) with loss (``loss_at``)
    at or below it; else the stored ``targets`` entry; None if not reached."""
    at, sign = ("loss_at", -1.0) if metric == "test_loss" else ("acc_at", 1.0)
    if at in row:
        return next((int(k) for k, a in sorted(row[at].items(), key=lambda kv: int(kv[0]))
                     if sign * a >= sign * float(target)), None)
    hit = row["targets"].get(target)
    return None if hit is None else int(hit["steps"])


def aggregate(results: list[dict[str, Any]], targets: list[str] | None = None) -> dict[str, dict[str, Any]]:
    """Per method (in the first run's order) over the runs: cost, steps and time to each target
    (default: the runs' own ``--targets``), final accuracy (module docstring). Every run must
    hold the same methods."""
    if not results:
        raise ValueError("peer_seeds: give at least one tools.peer_bench output")
    methods = list(results[0]["summary"])
    if targets is None:
        targets = list(next(iter(results[0]["summary"].values()))["targets"]) if methods else []
    metric = metric_of(results[0])
    for i, res in enumerate(results[1:], 1):
        if list(res["summary"]) != methods:
            raise ValueError(f"peer_seeds: run {i} has methods {list(res['summary'])}, run 0 has {methods}: "
                             "give runs of the same --methods")
        if metric_of(res) != metric:
            raise ValueError(f"peer_seeds: run {i} is raced on {metric_of(res)}, run 0 on {metric}: "
                             "give runs of the same --model")
    out: dict[str, dict[str, Any]] = {}
    for m in methods:
        rows = [res["summary"][m] for res in results]
        cost = statistics.fmean(r["ratio_to_sgd"] for r in rows)
        per_target = {}
        for t in targets:
            steps = [n for n in (steps_to(r, t, metric) for r in rows) if n is not None]
            mean, half = _spread(steps) if steps else (None, None)
            per_target[t] = {"steps_mean": mean, "steps_spread": half, "reached": len(steps),
                             "time": mean * cost if steps and len(steps) == len(rows) else None}
        acc_mean, acc_half = _spread([r["final_acc"] for r in rows])
        out[m] = {"family": _family(m, rows[0]), "cost": cost, "targets": per_target, "metric": metric,
                  "final_acc_mean": acc_mean, "final_acc_spread": acc_half, "seeds": len(rows)}
        if all("final_loss" in r for r in rows):
            out[m]["final_loss_mean"], out[m]["final_loss_spread"] = _spread([r["final_loss"] for r in rows])
        mems = [r["peak_memory_mb"] for r in rows if r.get("peak_memory_mb") is not None]
        out[m]["peak_memory_mb"] = statistics.fmean(mems) if len(mems) == len(rows) else None
    return out


def verdict(agg: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """``tools.peer_methods.verdict`` over the seeds: per target the fastest TENGraD and the fastest
    rival by ``time`` (where every seed reached it) and TENGraD's ratio; the best mean final
    accuracy of each family."""
    summary = {m: {"family": a["family"], "final_acc": a["final_acc_mean"], "final_loss": a.get("final_loss_mean"),
                   "targets": {t: hit if hit["time"] is not None else None for t, hit in a["targets"].items()}}
               for m, a in agg.items()}
    targets = list(next(iter(agg.values()))["targets"]) if agg else []
    lm = bool(agg) and next(iter(agg.values()))["metric"] == "test_loss"
    return peer_verdict(summary, targets, key="time", final="final_loss" if lm else "final_acc")


def _pct(t: str, lm: bool = False) -> str:
    return f"loss {float(t):g}" if lm else f"{float(t) * 100:g} %"


def table(agg: dict[str, dict[str, Any]]) -> str:
    """The markdown table of ``aggregate``'s result."""
    targets = list(next(iter(agg.values()))["targets"]) if agg else []
    n = max((a["seeds"] for a in agg.values()), default=0)
    lm = bool(agg) and next(iter(agg.values()))["metric"] == "test_loss"
    mem = any(a["peak_memory_mb"] is not None for a in agg.values())
    head = ["method", "step cost × SGD"] + [f"steps to {_pct(t, lm)}" for t in targets] + \
        [f"time to {_pct(t, lm)}" for t in targets] + ["final loss (nats/byte)" if lm else "final acc."] + \
        (["peak MB"] if mem else [])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for m, a in agg.items():
        steps, times = [], []
        for t in targets:
            hit = a["targets"][t]
            if hit["steps_mean"] is None:
                steps.append("–")
            else:
                k = "" if hit["reached"] == a["seeds"] else f" ({hit['reached']} of {a['seeds']})"
                steps.append(f"{hit['steps_mean']:.0f} ± {hit['steps_spread']:.0f}{k}")
            times.append("–" if hit["time"] is None else f"{hit['time']:.0f}")
        final = f"{a['final_loss_mean']:.3f} ± {a['final_loss_spread']:.3f}" if lm else \
            f"{a['final_acc_mean'] * 100:.1f} ± {a['final_acc_spread'] * 100:.1f} %"
        peak = ["–" if a["peak_memory_mb"] is None else f"{a['peak_memory_mb']:.0f}"] if mem else []
        lines.append("| " + " | ".join([m, f"{a['cost']:.2f}", *steps, *times, final, *peak]) + " |")
    lines.append(f"\n{n} seed(s); mean ± half the min–max range; time = mean steps × mean cost, in SGD steps.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("runs", nargs="+", help="tools.peer_bench --out directories (or results.json files), one per seed")
    ap.add_argument("--targets", default=None,
                    help="comma-separated test accuracies (default: the runs' own), e.g. 0.85,0.87,0.88; "
                         "validation losses in nats/byte for language models, e.g. 2.7,2.6,2.5")
    ap.add_argument("--out", default=None, help="write the table and the verdict to this markdown file")
    ap.add_argument("--json", default=None, help="write the aggregate and the verdict to this JSON file")
    args = ap.parse_args(argv)
    targets = None if args.targets is None else [f"{float(t):g}" for t in args.targets.split(",")]
    agg = aggregate([load(p) for p in args.runs], targets)
    v = verdict(agg)
    final = "mean final loss" if "final_loss" in v else "mean final accuracy"
    lines = peer_verdict_lines(v, key="time", unit="SGD steps",
                               what=f"time in SGD steps where every seed reached the target, {final}")
    text = table(agg) + "\n\n" + "\n".join(lines) + "\n"
    print(text, end="")
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"methods": agg, "verdict": v}, f, indent=2)
    return {"methods": agg, "verdict": v}


if __name__ == "__main__":
    main()
