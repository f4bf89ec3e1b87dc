"""TENGraD against peer optimizers: accuracy against steps and seconds, and the cost of a step.

    python -m tools.peer_bench [--model 3c1f] [--dataset fashion-mnist] [--data-dir DIR]
                               [--methods sgd,adamw,tengrad,kfac,muon,soap,shampoo,psgd]
                               [--tengrad 'NAME:key=value,...' ...]
                               [--steps 300] [--batch-size 128] [--subset N] [--eval-every 25]
                               [--eval-subset 2000] [--targets 0.85,0.88] [--lr-grid 1|3|5]
                               [--schedule constant|cosine]
                               [--warmup 2] [--seed 0] [--device cpu|cuda] [--threads N]
                               [--out DIR] [--plot]

Methods (``METHODS``; ``--methods all`` = every one):

* ``sgd``, ``tengrad``, ``kfac``: ``tengrad_fx.optim.registry.make_optimizer`` with the
  paper's Fashion-MNIST settings (SGD: lr 0.03, weight decay 1e-3, momentum 0.9; TENGraD:
  MC Fisher, curvature every 100 steps, KL clip 0.01; K-FAC: MC Fisher, statistics every
  20 steps, inversion every 100, KL clip 0.01). TENGraD and K-FAC train a model prepared
  by ``tengrad_fx.prepare``. ``tengrad-orth``: the preset ``"orthogonal"`` (each weight's
  NGD update replaced by its exact polar factor at RMS 0.2, RMSProp-grafted biases, lr 1e-3);
  ``tengrad-orth-ns``: the same with Muon's five Newton–Schulz steps for the polar factor.
* ``adamw``: ``torch.optim.AdamW`` at torch's defaults (lr 1e-3, betas (0.9, 0.999),
  weight decay 0.01).
* ``muon``, ``soap``, ``shampoo``, ``psgd``: ``pytorch_optimizer``'s ``Muon``, ``SOAP``,
  ``Shampoo`` and ``Kron`` (PSGD with Kronecker-factored preconditioners) at that library's
  defaults; Muon takes the ≥2-D weights, the rest (biases) go to its built-in AdamW
  (``use_muon=False`` groups). These need the ``peers`` extra
  (``pip install 'tengrad-fx[peers]'``); without it they fail with a message naming it,
  and the other four run.

``--tengrad 'k32:curvature_samples=32'`` adds a TENGraD variant: the paper's settings with
those keyword overrides (``preset=NAME`` stands for a preset's options), as in ``tools.ablate``.

``--schedule cosine`` gives every run the same lr schedule (``LambdaLR``: its lr times
``½(1 + cos(π·t/steps))`` after ``t`` steps, down to 0 at ``--steps``); default constant.

``--lr-grid K`` (odd K) trains every method at its default lr × 3^j for j = −K//2 … K//2
(``3`` = default × {1/3, 1, 3}); the summary keeps, per method, the lr with the best final
test accuracy (ties: the lower final test loss) and says which.

Every run starts from the same initial weights (``--seed``) and sees the same batches in
the same order (one shuffled order of the training set per epoch, drawn once for all).
All runs advance in lockstep: in each round every run takes one step, the order of the
runs rotating by one each round, so machine noise hits every method alike. Each step
(forward, backward, ``opt.step()``; on CUDA between two ``torch.cuda.synchronize()``) is
timed; evaluation is off the clock: every ``--eval-every`` steps and at the end, test
loss and accuracy on a fixed subset of the test set (``--eval-subset`` images).

Per run: the curve (step, measured seconds, estimated seconds, test accuracy and loss);
``ratio_to_sgd`` = the run's summed step time over SGD's (default lr) summed over the
same rounds after ``--warmup`` rounds, i.e. the amortized per-step cost of an interleaved
measurement (TENGraD's and K-FAC's curvature steps every 100 are in the sum); ``seconds``
= its own measured step times, added up; ``est_seconds`` = steps × ratio_to_sgd × SGD's
mean step (after warm-up), the time a quieter machine would give each method if the
ratios hold; steps and both seconds to each ``--targets`` accuracy (the first evaluation
at or above it). A run whose loss turns non-finite stops there (``diverged_at``).

The verdict (printed under the table, ``verdict`` in ``results.json``): per target, the
fastest TENGraD run (any ``tengrad*`` method or ``--tengrad`` variant) against the fastest
rival (``adamw``, ``muon``, ``soap``, ``shampoo``, ``psgd``: what users pick instead; SGD and
K-FAC are the paper's baselines) in estimated seconds, and their ratio; and the best final
accuracy of each.

Outputs under ``--out``: ``results.json`` (config, every run, the summary, the verdict),
``curves.csv`` (one row per evaluation), ``summary.csv`` (one row per method), and with
``--plot`` ``curves.png`` (matplotlib, optional: skipped with a note when missing).
"""
from __future__ import annotations

import argparse
import copy
import csv
import json
import math
import os
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

import tengrad_fx
from tengrad_fx import zoo
from tengrad_fx.zoo.bench_models import MODEL_NAMES, build_model
from tools.peer_methods import (METHODS, PEER_PACKAGE, PEERS, RIVALS, Method, parse_variant, peer_library,
                                peer_versions, tengrad_method)

DEFAULT_METHODS = "sgd,adamw,tengrad,kfac,muon,soap,shampoo,psgd"


def lr_factors(k: int) -> list[float]:
    """The ``--lr-grid`` multipliers of the default lr: 3^j for j = −k//2 … k//2 (odd ``k``)."""
    if k < 1 or k % 2 == 0:
        raise ValueError(f"--lr-grid must be an odd number ≥ 1, got {k}")
    return [3.0 ** j for j in range(-(k // 2), k // 2 + 1)]


@dataclass
class Run:
    """One (method, lr): its model, optimizer, step times (seconds, one per step) and curve."""

    method: Method
    lr: float
    model: nn.Module
    opt: torch.optim.Optimizer
    times: list[float] = field(default_factory=list)
    curve: list[dict[str, float]] = field(default_factory=list)
    diverged_at: int | None = None
    sched: Any = None  # a torch.optim.lr_scheduler stepped after every step (--schedule)

    @property
    def name(self) -> str:
        return f"{self.method.name}@{self.lr:.3g}"

    def step(self, x: torch.Tensor, y: torch.Tensor, sync: Callable[[], None]) -> None:
        """One training step on ``x`` (B × C × H × W), ``y`` (B,), timed (``self.times``)."""
        sync()
        t0 = time.perf_counter()
        self.opt.zero_grad(set_to_none=True)
        out = self.model(x)
        loss = F.cross_entropy(out, y)
        if hasattr(self.opt, "mc_capture"):
            self.opt.mc_capture(out)
        loss.backward()
        self.opt.step()
        sync()
        self.times.append(time.perf_counter() - t0)
        if self.sched is not None:
            self.sched.step()
        if not math.isfinite(float(loss.detach())):
            self.diverged_at = len(self.times)


SCHEDULES = ("constant", "cosine")
"""The ``--schedule`` choices of this benchmark and ``tools.ablate`` (:func:`lr_multiplier`)."""


def lr_multiplier(schedule: str, steps: int) -> Callable[[int], float]:
    """``--schedule``: the factor on every group's lr after ``t`` steps: ``"constant"`` 1,
    ``"cosine"`` ``½(1 + cos(π·t/steps))`` (from 1 to 0 over the run)."""
    if schedule == "constant":
        return lambda t: 1.0
    if schedule == "cosine":
        return lambda t: 0.5 * (1.0 + math.cos(math.pi * min(t, steps) / steps))
    raise ValueError(f"--schedule must be 'constant' or 'cosine', got {schedule!r}")


def make_run(method: Method, lr: float, base: nn.Module, example: torch.Tensor, schedule: str = "constant",
             steps: int = 1) -> Run:
    """A run of ``method`` at ``lr`` on a copy of ``base`` (prepared where the method needs it),
    its lr following ``schedule`` over ``steps`` (:func:`lr_multiplier`)."""
    model = copy.deepcopy(base)
    if method.prepared:
        model = tengrad_fx.prepare(model, example_inputs=(example[:2],))
    opt = method.build(model, lr)
    sched = None if schedule == "constant" else \
        torch.optim.lr_scheduler.LambdaLR(opt, lr_multiplier(schedule, steps))
    return Run(method, lr, model, opt, sched=sched)


def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch: int = 1000) -> tuple[float, float]:
    """(mean cross-entropy, accuracy) of ``model`` on ``x`` (N × C × H × W), ``y`` (N,), in eval mode."""
    was = model.training
    model.eval()
    loss, correct = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(y), batch):
            out = model(x[i:i + batch]).float()
            loss += float(F.cross_entropy(out, y[i:i + batch], reduction="sum"))
            correct += int((out.argmax(-1) == y[i:i + batch]).sum())
    model.train(was)
    return loss / len(y), correct / len(y)


def batch_order(n: int, batch: int, steps: int, seed: int) -> list[torch.Tensor]:
    """Index tensors (``batch``,) of ``steps`` steps: a fresh permutation of ``n`` per epoch
    (last partial batch dropped), from one generator seeded with ``seed``."""
    g = torch.Generator().manual_seed(seed)
    out: list[torch.Tensor] = []
    while len(out) < steps:
        perm = torch.randperm(n, generator=g)
        out += [perm[i:i + batch] for i in range(0, n - batch + 1, batch)]
    return out[:steps]


def load_data(args: argparse.Namespace, dev: torch.device) -> tuple[Any, torch.Tensor, torch.Tensor]:
    """(training set on ``dev``, test images, test labels): the fixed ``--eval-subset`` of the test set."""
    train = zoo.get_dataset(args.dataset, "train", data_dir=args.data_dir)
    if args.subset:
        train = zoo.subset(train, args.subset, seed=args.seed)
    test = zoo.subset(zoo.get_dataset(args.dataset, "test", data_dir=args.data_dir), args.eval_subset, seed=0)
    return train.to(dev), test.x.to(dev), test.y.to(dev)


def train(args: argparse.Namespace) -> dict[str, Any]:
    """Every run in lockstep; returns the results dictionary written as ``results.json``."""
    dev = torch.device(args.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    train_set, xt, yt = load_data(args, dev)
    torch.manual_seed(args.seed)
    base = build_model(args.model)[0].to(dev)
    names = args.methods.split(",")
    if "sgd" not in names:
        names.insert(0, "sgd")  # the timing reference
    methods = [METHODS[m] for m in names] + [tengrad_method(*parse_variant(s)) for s in args.tengrad]
    runs = [make_run(m, float(f"{m.lr * f:.6g}"), base, train_set.x[:2], args.schedule, args.steps) for m in methods
            for f in lr_factors(args.lr_grid)]
    ref = next(r for r in runs if r.method.name == "sgd" and r.lr == METHODS["sgd"].lr)
    order = batch_order(len(train_set), args.batch_size, args.steps, args.seed)

    def record(run: Run, step: int) -> None:
        loss, acc = evaluate(run.model, xt, yt)
        run.curve.append({"step": step, "seconds": sum(run.times), "test_acc": acc, "test_loss": loss})

    for run in runs:
        record(run, 0)
    for step, idx in enumerate(order, 1):
        idx = idx.to(dev)
        x, y = train_set.x.index_select(0, idx), train_set.y.index_select(0, idx)
        k = (step - 1) % len(runs)
        for run in runs[k:] + runs[:k]:
            if run.diverged_at is None:
                run.step(x, y, sync)
        if step % args.eval_every == 0 or step == args.steps:
            for run in runs:
                if run.diverged_at is None:
                    record(run, step)
        if args.verbose and step % args.eval_every == 0:
            print(f"step {step}: " + ", ".join(f"{r.name} {r.curve[-1]['test_acc']:.3f}" for r in runs), flush=True)
    return summarize(args, runs, ref, dev)


def ratio(run: Run, ref: Run, warmup: int) -> float:
    """Summed step time of ``run`` over ``ref``'s, over the rounds both took after ``warmup``."""
    n = min(len(run.times), len(ref.times))
    if n <= warmup:
        warmup = 0
    return sum(run.times[warmup:n]) / sum(ref.times[warmup:n])


def to_target(curve: list[dict[str, float]], target: float) -> dict[str, float] | None:
    """The first evaluation of ``curve`` with test accuracy ≥ ``target`` (None if none)."""
    return next((c for c in curve if c["test_acc"] >= target), None)


def summarize(args: argparse.Namespace, runs: list[Run], ref: Run, dev: torch.device) -> dict[str, Any]:
    """Per run: ratio, estimated seconds, targets; per method: the best lr's run (module docstring)."""
    w = args.warmup
    sgd_step = statistics.fmean(ref.times[w:] if len(ref.times) > w else ref.times)
    out_runs = []
    for run in runs:
        r = ratio(run, ref, w)
        for c in run.curve:
            c["est_seconds"] = c["step"] * r * sgd_step
        row: dict[str, Any] = {
            "method": run.method.name, "lr": run.lr, "lr_default": run.method.lr, "settings": run.method.settings,
            "family": family(run.method),
            "ratio_to_sgd": r, "step_seconds_mean": statistics.fmean(run.times) if run.times else float("nan"),
            "step_seconds_median": statistics.median(run.times) if run.times else float("nan"),
            "steps": len(run.times), "seconds": sum(run.times), "diverged_at": run.diverged_at,
            "final_acc": run.curve[-1]["test_acc"], "final_loss": run.curve[-1]["test_loss"],
            "acc_at": {str(c["step"]): c["test_acc"] for c in run.curve}, "curve": run.curve, "targets": {}}
        for t in args.targets:
            hit = to_target(run.curve, t)
            row["targets"][f"{t:g}"] = None if hit is None else {
                "steps": hit["step"], "seconds": hit["seconds"], "est_seconds": hit["est_seconds"]}
        out_runs.append(row)
    best: dict[str, dict[str, Any]] = {}
    for row in out_runs:
        cur = best.get(row["method"])
        key = (row["final_acc"], -row["final_loss"] if math.isfinite(row["final_loss"]) else -math.inf)
        if cur is None or key > (cur["final_acc"], -cur["final_loss"] if math.isfinite(cur["final_loss"])
                                 else -math.inf):
            best[row["method"]] = row
    config = {k: v for k, v in vars(args).items() if k not in ("out", "plot", "verbose")}
    config.update(device=str(dev), threads=torch.get_num_threads(), torch=torch.__version__,
                  date_utc=time.strftime("%Y-%m-%d %H:%M", time.gmtime()), sgd_step_seconds=sgd_step,
                  lr_factors=lr_factors(args.lr_grid), versions=peer_versions())
    summary = {m: {k: v for k, v in row.items() if k != "curve"} | {"lr_won": row["lr"]}
               for m, row in best.items()}
    return {"config": config, "runs": out_runs, "summary": summary,
            "verdict": verdict(summary, [f"{t:g}" for t in args.targets])}


def family(method: Method) -> str:
    """``"tengrad"`` (any TENGraD), ``"rival"`` (what users pick instead: ``RIVALS``) or ``"baseline"``."""
    return "tengrad" if method.tengrad else "rival" if method.name in RIVALS else "baseline"


def verdict(summary: dict[str, dict[str, Any]], targets: list[str], key: str = "est_seconds") -> dict[str, Any]:
    """The fastest TENGraD against the fastest rival (by ``targets[t][key]``, estimated seconds)
    to each target, and the best final accuracy of each; ``ratio`` = TENGraD's time over the
    rival's (None where either reached no target, or either family did not run)."""
    groups = {f: {m: s for m, s in summary.items() if s["family"] == f} for f in ("tengrad", "rival")}
    out: dict[str, Any] = {"targets": {}, "final_acc": {}}
    for t in targets:
        best: dict[str, Any] = {}
        for f, group in groups.items():
            hits = [(s["targets"][t][key], m) for m, s in group.items() if s["targets"][t]]
            fastest = min(hits, default=None)
            best[f] = None if fastest is None else {"method": fastest[1], key: fastest[0]}
        tg, rv = best["tengrad"], best["rival"]
        ratio_ = tg[key] / rv[key] if tg and rv and rv[key] > 0 else None
        out["targets"][t] = {**best, "ratio": ratio_}
    for f, group in groups.items():
        top = max(group, key=lambda m: group[m]["final_acc"], default=None)
        out["final_acc"][f] = None if top is None else {"method": top, "final_acc": group[top]["final_acc"]}
    return out


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
    with open(os.path.join(out, "summary.csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["method", "lr_won", "lr_default", "ratio_to_sgd", "final_acc", "final_loss", "seconds",
                    "diverged_at"] + [f"{k}_{t}" for t in targets for k in ("steps", "seconds", "est_seconds")])
        for m, s in res["summary"].items():
            hits = [(s["targets"][t] or {}).get(k) for t in targets for k in ("steps", "seconds", "est_seconds")]
            w.writerow([m, s["lr_won"], s["lr_default"], s["ratio_to_sgd"], s["final_acc"], s["final_loss"],
                        s["seconds"], s["diverged_at"], *hits])
    if plot:
        plot_curves(res, os.path.join(out, "curves.png"))


def plot_curves(res: dict[str, Any], path: str) -> None:
    """Test accuracy of every method's winning run against steps and estimated seconds."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install 'tengrad-fx[plot]')")
        return
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    won = {(s["method"], s["lr"]) for s in res["summary"].values()}
    for run in res["runs"]:
        if (run["method"], run["lr"]) not in won:
            continue
        c = run["curve"]
        label = f"{run['method']} (lr {run['lr']:.3g})"
        axes[0].plot([p["step"] for p in c], [p["test_acc"] for p in c], label=label)
        axes[1].plot([p["est_seconds"] for p in c], [p["test_acc"] for p in c], label=label)
        axes[2].plot([p["step"] for p in c], [p["test_loss"] for p in c], label=label)
    for ax, (xl, yl) in zip(axes, [("step", "test accuracy"), ("estimated seconds", "test accuracy"),
                                   ("step", "test loss")]):
        ax.set_xlabel(xl)
        ax.set_ylabel(yl)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def report(res: dict[str, Any]) -> str:
    """The summary table: per method the winning lr, steps and seconds to each target, final
    accuracy, and the step cost as a multiple of SGD's."""
    cfg = res["config"]
    lines = [f"model={cfg['model']} batch={cfg['batch_size']} steps={cfg['steps']} device={cfg['device']} "
             f"threads={cfg['threads']} torch={cfg['torch']} {PEER_PACKAGE}={cfg['versions'].get(PEER_PACKAGE)} "
             f"SGD step {cfg['sgd_step_seconds'] * 1e3:.1f} ms"]
    targets = list(next(iter(res["summary"].values()))["targets"]) if res["summary"] else []
    head = f"{'method':<9}{'lr':>9}{'x SGD':>8}{'final acc':>10}{'seconds':>9}"
    lines.append(head + "".join(f"{'steps@' + t:>11}{'est s@' + t:>11}" for t in targets))
    for m, s in res["summary"].items():
        row = f"{m:<9}{s['lr_won']:>9.3g}{s['ratio_to_sgd']:>8.2f}{s['final_acc']:>10.4f}{s['seconds']:>9.1f}"
        for t in targets:
            hit = s["targets"][t]
            row += f"{'-':>11}{'-':>11}" if hit is None else f"{hit['steps']:>11d}{hit['est_seconds']:>11.1f}"
        lines.append(row + (f"  diverged at {s['diverged_at']}" if s["diverged_at"] else ""))
    return "\n".join(lines + verdict_lines(res.get("verdict")))


def verdict_lines(v: dict[str, Any] | None, key: str = "est_seconds", unit: str = "s",
                  what: str = "estimated seconds") -> list[str]:
    """The verdict (times under ``key``, in ``unit``) as lines (none when TENGraD or no rival ran)."""
    if not v or not all(v["final_acc"].values()):
        return []
    lines = ["fastest TENGraD against the fastest of " + ", ".join(RIVALS) + f" (those run), {what}:"]
    for t, hit in v["targets"].items():
        tg, rv = hit["tengrad"], hit["rival"]
        both = f"{tg['method']} {tg[key]:.3g} {unit}, {rv['method']} {rv[key]:.3g} {unit}" if tg and rv else \
            f"{tg['method'] if tg else 'no TENGraD'} against {rv['method'] if rv else 'no rival'}"
        ratio_ = f": {hit['ratio']:.2f}x" if hit["ratio"] is not None else ""
        lines.append(f"  to {t}: {both}{ratio_}")
    tg, rv = v["final_acc"]["tengrad"], v["final_acc"]["rival"]
    lines.append(f"  final accuracy: {tg['method']} {tg['final_acc']:.4f}, {rv['method']} {rv['final_acc']:.4f}")
    return lines


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="3c1f", choices=list(MODEL_NAMES))
    ap.add_argument("--dataset", default="fashion-mnist")
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--methods", default=DEFAULT_METHODS, help=f"comma list of {sorted(METHODS)}, or 'all'")
    ap.add_argument("--tengrad", action="append", default=[],
                    help="a TENGraD variant 'name:key=value,...' (the paper's settings plus these; repeatable)")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--subset", type=int, default=0, help="train on the first N of a fixed shuffle (0: all)")
    ap.add_argument("--eval-every", type=int, default=25)
    ap.add_argument("--eval-subset", type=int, default=2000, help="test images evaluated (a fixed subset)")
    ap.add_argument("--targets", default="0.85,0.88", help="test accuracies (fractions)")
    ap.add_argument("--lr-grid", type=int, default=1, help="odd K: default lr × 3^j, j = -K//2..K//2")
    ap.add_argument("--warmup", type=int, default=2, help="rounds left out of the step-cost ratios")
    ap.add_argument("--schedule", default="constant", choices=SCHEDULES,
                    help="every method's lr: constant, or cosine from its lr to 0 over --steps")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's)")
    ap.add_argument("--out", default=None, help="directory of results.json, curves.csv, summary.csv")
    ap.add_argument("--plot", action="store_true", help="also curves.png (matplotlib)")
    ap.add_argument("--verbose", action="store_true", help="print accuracies at every evaluation")
    args = ap.parse_args(argv)
    if args.methods == "all":
        args.methods = ",".join(METHODS)
    unknown = [m for m in args.methods.split(",") if m not in METHODS]
    if unknown:
        ap.error(f"unknown methods {unknown}; choose from {sorted(METHODS)}")
    if any(m in PEERS for m in args.methods.split(",")):
        peer_library()
    args.targets = [float(t) / (100 if float(t) > 1 else 1) for t in args.targets.split(",") if t]
    lr_factors(args.lr_grid)
    if args.threads:
        torch.set_num_threads(args.threads)
    res = train(args)
    print(report(res))
    if args.out:
        write_outputs(res, args.out, args.plot)
    return res


if __name__ == "__main__":
    main()
