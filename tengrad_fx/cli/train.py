"""Train a zoo model with TENGraD (or SGD / K-FAC / EK-FAC / KBFGS) and log everything.

    tengrad-train                       # 3C1F + TENGraD on Fashion-MNIST, one epoch
    tengrad-train --optimizer sgd --epochs 5 --subset 5000
    tengrad-train --model wrn-28-4 --dataset cifar10 --data-dir ~/data --epochs 60
    tengrad-train --out runs/x --resume  # continue from runs/x/checkpoint.pt

(the console script; also ``python -m tengrad_fx.cli.train``, or ``python -m tools.train``
from the repository). Cost on a 2-core CPU (2 threads, an idle machine): SGD's 3C1F step
at batch 128 takes about 0.5 s, TENGraD's with the paper's settings (MC Fisher,
``T = 100``) about 1.07× that amortized (a curvature step 1.2–1.8×; docs/performance.md),
so one Fashion-MNIST epoch (469 steps) takes several minutes plus the test-set
evaluation, and much longer on a loaded machine. Use ``--subset N`` /
``--max-steps N`` for smoke runs and ``--device cuda`` for real ones.

Hyperparameters: the paper's by default
---------------------------------------
Every hyperparameter not given defaults to the paper's run of the (optimizer, dataset,
model) triple, :func:`tengrad_fx.optim.registry.paper_settings`:

* ``--lr``, ``--weight-decay``, ``--damping``: the appendix's tuned values
  (``PAPER_DEFAULTS[optimizer][dataset][model]``; Fashion-MNIST: 3C1F, CIFAR-10/100:
  wrn-28-4, densenet-19, mobilenetv2). Another model on CIFAR takes the wrn-28-4 row
  (said in ``config.json``'s ``defaults_from``).
* ``--momentum`` 0.9 for all.
* ``--fisher``: ``mc`` (one label sampled per example from the model's prediction, on
  curvature steps only) for TENGraD, K-FAC and EK-FAC, as in the authors' code.
* ``--curvature-every``: TENGraD's curvature period, 100 (the paper's "frequency of
  inversion"); K-FAC / EK-FAC / KBFGS take ``PAPER_INTERVALS`` (statistics every 20 steps,
  inversion every 100) and reject the option.
* ``--kl-clip``: 0.01 (the authors' code) for every method except SGD; 0 turns it off.
* ``--lr-schedule`` (in epochs): ``const`` on Fashion-MNIST, ``step:10:0.5`` on CIFAR-10,
  ``multistep:30,45:0.1`` on CIFAR-100: ``lr(epoch e, 0-based) = lr · FACTOR^(e // EVERY)``
  resp. ``lr · FACTOR^(#{Ei <= e})``; it is applied at the start of every epoch.

Without a dataset, ``TENGraD(model, lr, damping)`` uses the empirical Fisher with
curvature every 100 steps and KL clip 0.01. The empirical Fisher with curvature every step
and no clip (``--fisher empirical --curvature-every 1 --kl-clip 0``) gives exact per-step
updates but trains markedly worse on 3C1F / Fashion-MNIST (docs/paper.md).

Optimizers are built by ``tengrad_fx.optim.registry.make_optimizer`` with every value
explicit. SGD gets the plain model; every other optimizer the model
prepared by :func:`tengrad_fx.prepare`; if the optimizer has ``mc_capture`` (MC Fisher)
it is called on the logits before ``loss.backward()`` (also needed under
``torch.compile(fullgraph=True)``). ``--subset N`` trains on
``zoo.subset(train, N)`` (a fixed shuffle, seed 0, so every ``--seed`` sees the same
samples) and evaluates on ``zoo.subset(test, N)`` (``--test-subset M``: on M test
samples instead, 0 = the whole test set).

Files written to ``--out`` (default ``runs/<model>-<dataset>-<optimizer>-s<seed>``) and the
log columns are documented in :mod:`tengrad_fx.cli._loop`, which runs the training loop.
"""
from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

import torch
import torch.nn as nn

from .. import zoo
from ..utils.memory import steady_malloc
from ..optim import registry
from . import _loop
from ._loop import CHECKPOINT, EVAL_BATCH, evaluate, save_checkpoint  # noqa: F401  (re-exported)

__all__ = ["LR_SCHEDULE_DEFAULTS", "OPTIMIZER_NAMES", "build_parser", "lr_factor",
           "main", "parse_lr_schedule", "resolve_config", "run"]

OPTIMIZER_NAMES = ("sgd", "tengrad", "kfac", "ekfac", "kbfgs")

LR_SCHEDULE_DEFAULTS = registry.PAPER_LR_SCHEDULES

_DATASET_ALIASES = {
    "fashion-mnist": "fashion-mnist", "fashionmnist": "fashion-mnist", "fmnist": "fashion-mnist",
    "cifar10": "cifar10", "cifar-10": "cifar10", "cifar100": "cifar100", "cifar-100": "cifar100",
}


class ConfigError(ValueError):
    """A bad argument combination (reported by ``main`` as a usage error)."""


# --------------------------------------------------------------------------- arguments


class _HelpFormatter(argparse.HelpFormatter):
    """Appends ``(default: X)`` where there is a default worth showing."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default not in (None, False, argparse.SUPPRESS) and "default" not in text:
            text += " (default: %(default)s)"
        return text


def build_parser() -> argparse.ArgumentParser:
    called = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    p = argparse.ArgumentParser(
        prog="tengrad-train" if called.startswith("tengrad-train") else "python -m tengrad_fx.cli.train",
        description="Train a zoo model with TENGraD / SGD / K-FAC / EK-FAC / KBFGS; logs, checkpoint and "
                    "summary go to --out (see tengrad_fx.cli._loop's docstring for the files and log columns).",
        formatter_class=_HelpFormatter,
    )
    p.add_argument("--model", default="3c1f", help="zoo model: 3c1f, wrn-28-4, densenet-19, mobilenetv2, "
                                                   "timm:<name>, torchvision:<name>")
    p.add_argument("--dataset", default="fashion-mnist", help="fashion-mnist, cifar10 or cifar100")
    p.add_argument("--optimizer", default="tengrad", choices=OPTIMIZER_NAMES, help="optimizer")
    p.add_argument("--epochs", type=int, default=1, help="total epochs (also when resuming)")
    p.add_argument("--batch-size", type=int, default=128, help="training batch size")
    p.add_argument("--lr", type=float, default=None, help="default: paper value for (optimizer, dataset, model)")
    p.add_argument("--momentum", type=float, default=0.9, help="momentum (all optimizers)")
    p.add_argument("--weight-decay", type=float, default=None, help="default: paper value")
    p.add_argument("--damping", type=float, default=None, help="default: paper value (not used by sgd)")
    p.add_argument("--curvature-every", type=int, default=None,
                   help="TENGraD curvature period T in steps (default: the paper's 100); kfac/ekfac/kbfgs use the "
                        "paper intervals")
    p.add_argument("--fisher", choices=("empirical", "mc"), default=None,
                   help="empirical, or Monte-Carlo: labels sampled from the model (default: mc, the paper's, for "
                        "tengrad/kfac/ekfac)")
    p.add_argument("--kl-clip", type=float, default=None,
                   help="KL clip of the update (default: the paper code's 0.01; 0 = off; not for sgd)")
    p.add_argument("--lr-schedule", default=None,
                   help="const | step:EVERY:FACTOR | multistep:E1,E2,...:FACTOR (epochs); default: const for "
                        "fashion-mnist, step:10:0.5 for cifar10, multistep:30,45:0.1 for cifar100")
    p.add_argument("--seed", type=int, default=0, help="model init, data order, MC sampling")
    p.add_argument("--device", default="auto", help="auto (cuda if available, else cpu), cpu, cuda, cuda:1, ...")
    p.add_argument("--compile", action="store_true", help="torch.compile the model's forward")
    p.add_argument("--subset", type=int, default=None, metavar="N",
                   help="train on N samples (zoo.subset, fixed seed 0) and test on N test samples")
    p.add_argument("--test-subset", type=int, default=None, metavar="M",
                   help="evaluate on M test samples (0 = the whole test set; default: as --subset)")
    p.add_argument("--max-steps", "--steps-limit", dest="max_steps", type=int, default=None, metavar="N",
                   help="stop after N optimizer steps in total (smoke runs, tests); a checkpoint is written")
    p.add_argument("--out", default=None, help="output directory (default runs/<model>-<dataset>-<optimizer>-s<seed>)")
    p.add_argument("--resume", action="store_true",
                   help="continue from OUT/checkpoint.pt (starts from scratch if there is none)")
    p.add_argument("--data-dir", default=None, help="where to look for the dataset files first")
    p.add_argument("--download", action="store_true", help="allow a torchvision download of the dataset")
    p.add_argument("--eval-every", type=int, default=0, metavar="STEPS",
                   help="also evaluate every STEPS steps (evals.jsonl); 0 = only at the end of each epoch")
    p.add_argument("--log-every", type=int, default=50, metavar="STEPS",
                   help="read the loss, accuracy and skips from the device and write steps.jsonl every STEPS "
                        "steps (also before evaluations and at the end of each epoch)")
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (0 = leave torch's default)")
    p.add_argument("--no-progress", action="store_true", help="no tqdm bar (it is also off when stderr is no TTY)")
    p.add_argument("--no-plot", action="store_true", help="do not draw OUT/curves.png at the end")
    p.add_argument("--distributed", action="store_true",
                   help="one process per rank under torchrun (DDP; TENGraD with the global batch's Fisher); "
                        "--batch-size is then the global batch (see tengrad_fx.cli._dist)")
    p.add_argument("--dist-mode", default="auto", choices=("auto", "gather", "gram-blocks", "local"),
                   help="--distributed TENGraD: the global-batch mode per layer (auto: the cost model picks gather "
                        "or gram-blocks), or local (per-rank Fisher, updates averaged)")
    return p


def canonical_dataset(name: str) -> str:
    key = _DATASET_ALIASES.get(name.strip().lower().replace("_", "-"))
    if key is None:
        raise ConfigError(f"unknown dataset {name!r}; valid names: fashion-mnist, cifar10, cifar100")
    return key


def parse_lr_schedule(spec: str) -> list[tuple[str, Any]]:
    """Validate an ``--lr-schedule`` string; returns a normalized description.

    ``const`` -> ``[("const", None)]``; ``step:E:F`` -> ``[("step", (E, F))]``;
    ``multistep:E1,E2:F`` -> ``[("multistep", ((E1, E2), F))]``.
    """
    s = spec.strip().lower()
    try:
        if s == "const":
            return [("const", None)]
        kind, *rest = s.split(":")
        if kind == "step" and len(rest) == 2:
            every, factor = int(rest[0]), float(rest[1])
            if every < 1:
                raise ValueError
            return [("step", (every, factor))]
        if kind == "multistep" and len(rest) == 2:
            milestones = tuple(int(e) for e in rest[0].split(","))
            factor = float(rest[1])
            if any(e < 0 for e in milestones) or list(milestones) != sorted(milestones):
                raise ValueError
            return [("multistep", (milestones, factor))]
    except ValueError:
        pass
    raise ConfigError(f"bad --lr-schedule {spec!r}: use const, step:EVERY:FACTOR or multistep:E1,E2,...:FACTOR "
                      "(EVERY >= 1, milestones ascending, in epochs)")


def lr_factor(spec: str, epoch: int) -> float:
    """Multiplier of the base lr in 0-based ``epoch`` under schedule ``spec``."""
    (kind, arg), = parse_lr_schedule(spec)
    if kind == "const":
        return 1.0
    if kind == "step":
        every, factor = arg
        return float(factor ** (epoch // every))
    milestones, factor = arg
    return float(factor ** sum(1 for e in milestones if e <= epoch))


def _paper_defaults(optimizer: str, dataset: str, model: str = "3c1f") -> dict[str, Any]:
    """The paper's settings for (``optimizer``, ``dataset``, ``model``), plus
    ``defaults_from``: which appendix row they are (a model without a row of its own takes
    the dataset's first paper model, wrn-28-4 on CIFAR)."""
    rows = registry.PAPER_MODELS[dataset]
    row = model.lower() if model.lower() in rows else rows[0]
    out = registry.paper_settings(optimizer, dataset, row)
    out["defaults_from"] = f"paper: {optimizer} / {dataset} / {row}" + ("" if row == model.lower() else
                                                                         f" (no row for {model})")
    return out


def resolve_config(args: argparse.Namespace) -> dict[str, Any]:
    """Fill in the (optimizer, dataset) defaults and validate; a plain dict of everything."""
    cfg = dict(vars(args))
    cfg["dataset"] = canonical_dataset(args.dataset)
    cfg["model"] = args.model.strip()
    if args.optimizer not in OPTIMIZER_NAMES:
        raise ConfigError(f"unknown optimizer {args.optimizer!r}; valid: {', '.join(OPTIMIZER_NAMES)}")
    defaults = _paper_defaults(args.optimizer, cfg["dataset"], cfg["model"])
    cfg["defaults_from"] = defaults["defaults_from"]
    if cfg["device"] == "auto":
        cfg["device"] = "cuda" if torch.cuda.is_available() else "cpu"
    not_for = {"sgd": ("damping", "curvature_every", "fisher", "kl_clip"), "kbfgs": ("curvature_every", "fisher"),
               "kfac": ("curvature_every",), "ekfac": ("curvature_every",), "tengrad": ()}[args.optimizer]
    for key in not_for:
        if vars(args)[key] is not None:
            raise ConfigError(f"--{key.replace('_', '-')} does not apply to --optimizer {args.optimizer}"
                              + ("" if key != "curvature_every" else "; it uses the paper's statistics/inversion "
                                 "periods (tengrad_fx.optim.registry.PAPER_INTERVALS)"))
    for key in ("lr", "weight_decay", "damping", "curvature_every", "fisher", "kl_clip"):
        if cfg[key] is None and key not in not_for:
            cfg[key] = defaults.get(key)
    if cfg["kl_clip"] == 0:
        cfg["kl_clip"] = None
    if cfg["lr_schedule"] is None:
        cfg["lr_schedule"] = LR_SCHEDULE_DEFAULTS[cfg["dataset"]]
    parse_lr_schedule(cfg["lr_schedule"])
    checks = [
        (args.epochs >= 1, f"--epochs must be >= 1, got {args.epochs}"),
        (args.batch_size >= 1, f"--batch-size must be >= 1, got {args.batch_size}"),
        (cfg["lr"] is not None and cfg["lr"] >= 0, f"--lr must be >= 0, got {cfg['lr']}"),
        (0 <= args.momentum < 1, f"--momentum must be in [0, 1), got {args.momentum}"),
        (cfg["weight_decay"] is not None and cfg["weight_decay"] >= 0,
         f"--weight-decay must be >= 0, got {cfg['weight_decay']}"),
        (cfg["damping"] is None or cfg["damping"] > 0, f"--damping must be > 0, got {cfg['damping']}"),
        (cfg["kl_clip"] is None or cfg["kl_clip"] > 0, f"--kl-clip must be >= 0, got {cfg['kl_clip']}"),
        (cfg["curvature_every"] is None or cfg["curvature_every"] >= 1,
         f"--curvature-every must be >= 1, got {cfg['curvature_every']}"),
        (args.subset is None or args.subset >= 1, f"--subset must be >= 1, got {args.subset}"),
        (args.test_subset is None or args.test_subset >= 0, f"--test-subset must be >= 0, got {args.test_subset}"),
        (args.max_steps is None or args.max_steps >= 1, f"--max-steps must be >= 1, got {args.max_steps}"),
        (args.eval_every >= 0, f"--eval-every must be >= 0, got {args.eval_every}"),
        (args.log_every >= 1, f"--log-every must be >= 1, got {args.log_every}"),
        (args.threads >= 0, f"--threads must be >= 0, got {args.threads}"),
    ]
    for ok, msg in checks:
        if not ok:
            raise ConfigError(msg)
    if cfg["out"] is None:
        safe_model = re.sub(r"[^A-Za-z0-9_.-]+", "_", cfg["model"])
        cfg["out"] = str(Path("runs") / f"{safe_model}-{cfg['dataset']}-{args.optimizer}-s{args.seed}")
    return cfg


# --------------------------------------------------------------------------- building blocks


def build_model(name: str, dataset: Any) -> nn.Module:
    kwargs: dict[str, Any] = {}
    if name.lower() == "3c1f" and dataset.x.shape[-1] != 28:
        kwargs["img_size"] = int(dataset.x.shape[-1])
    return zoo.get_model(name, num_classes=dataset.num_classes, in_chans=int(dataset.x.shape[1]), **kwargs)


def optimizer_kwargs(cfg: dict[str, Any]) -> dict[str, Any]:
    """Keyword arguments of the optimizer: lr, momentum, weight_decay; damping,
    curvature_every / fisher / kl_clip where they apply; the K-FAC-family
    ``PAPER_INTERVALS`` (statistics/inversion periods)."""
    name = cfg["optimizer"]
    kw: dict[str, Any] = dict(lr=cfg["lr"], momentum=cfg["momentum"], weight_decay=cfg["weight_decay"])
    if name != "sgd":
        kw["damping"] = cfg["damping"]
        kw["kl_clip"] = cfg["kl_clip"]
        for key in ("curvature_every", "fisher"):
            if cfg[key] is not None:
                kw[key] = cfg[key]
    if name != "tengrad":
        kw = {**registry.PAPER_INTERVALS.get(name, {}), **kw}
    return kw


def build_optimizer(cfg: dict[str, Any], model: nn.Module) -> torch.optim.Optimizer:
    """SGD over the plain model; any other optimizer over the prepared model, by
    ``tengrad_fx.optim.registry.make_optimizer`` with every value explicit; with
    ``--distributed``, TENGraD is :class:`tengrad_fx.distributed.DistributedTENGraD` (MC
    seed: ``--seed``; ``mode``: ``--dist-mode``)."""
    if cfg.get("distributed") and cfg["optimizer"] == "tengrad":
        from ..distributed import DistributedTENGraD

        return DistributedTENGraD(model, seed=cfg["seed"], mode=cfg.get("dist_mode") or "auto",
                                  **optimizer_kwargs(cfg))
    try:
        return registry.make_optimizer(cfg["optimizer"], model, **optimizer_kwargs(cfg))
    except TypeError as exc:  # an option this optimizer does not take
        raise ConfigError(f"--optimizer {cfg['optimizer']}: {exc}") from exc


# --------------------------------------------------------------------------- the run


def run(argv: Optional[Sequence[str]] = None) -> dict[str, Any]:
    """Parse ``argv``, train, write the logs; returns the summary dict.

    Raises:
        SystemExit: bad arguments (argparse's usage error, exit status 2).
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        cfg = resolve_config(args)
    except ConfigError as exc:
        parser.error(str(exc))
    if str(cfg["device"]).startswith("cpu"):
        steady_malloc()  # a CPU step reuses the heap the last one freed (no page faults per step)
    drun = None
    if cfg["distributed"]:
        from ._dist import DistRun, check_distributed

        try:
            drun = DistRun(args.device)
        except ValueError as exc:
            parser.error(str(exc))
        problem = check_distributed(cfg, drun.world)
        if problem:
            parser.error(problem)

    def setup(train_ds: Any) -> tuple[nn.Module, torch.optim.Optimizer, Optional[str], dict[str, Any]]:
        try:
            model = build_model(cfg["model"], train_ds).to(cfg["device"])
        except (ValueError, TypeError) as exc:
            parser.error(f"--model {cfg['model']}: {exc}")
        n_params = sum(p.numel() for p in model.parameters() if p.requires_grad)
        coverage = None
        if cfg["optimizer"] != "sgd":
            import tengrad_fx

            model = tengrad_fx.prepare(model, example_inputs=(train_ds.x[:2],))
            coverage = str(tengrad_fx.report(model, m=cfg["batch_size"]))
        try:
            opt = build_optimizer(cfg, model)
        except ConfigError as exc:
            parser.error(str(exc))
        return model, opt, coverage, {"n_params": n_params, "optimizer_kwargs": optimizer_kwargs(cfg)}

    try:
        summary = _loop.train(cfg, setup=setup, lr_factor=lr_factor, error=parser.error, dist=drun)
        if drun is not None:
            drun.barrier()  # rank 0's files are complete before any rank goes on (e.g. to a --resume)
        return summary
    finally:
        if drun is not None and drun.owns_group:
            drun.close()


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Console entry point (``tengrad-train``, ``python -m tengrad_fx.cli.train``)."""
    run(argv)
    from ._dist import leave_if_destroyed
    leave_if_destroyed()  # a torchrun rank: see its docstring


if __name__ == "__main__":
    main()
