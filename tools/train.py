"""Train a zoo model with TENGraD (or SGD / K-FAC / EK-FAC / KBFGS) and log everything.

    python -m tools.train                       # 3C1F + TENGraD on Fashion-MNIST, one epoch
    python -m tools.train --optimizer sgd --epochs 5 --subset 5000
    python -m tools.train --model wrn-28-4 --dataset cifar10 --data-dir ~/data --epochs 60
    python -m tools.train --out runs/x --resume  # continue from runs/x/checkpoint.pt

(also installed as the console script ``tengrad-train``). Cost on a 2-core CPU: a 3C1F
step at batch 128 is ~250 GFLOP for TENGraD (~180 for SGD); measured ~12 s (SGD ~8.5 s)
with the machine shared by other jobs, so one Fashion-MNIST epoch (469 steps, plus ~3 min
to evaluate 10k test images) takes over an hour there. Use ``--subset N`` /
``--max-steps N`` for smoke runs and ``--device cuda`` for real ones.

Hyperparameters
---------------
``--lr``, ``--weight-decay`` and ``--damping`` default to the paper's tuned values for the
(optimizer, dataset) pair (``tengrad_fx.optim.registry.PAPER_DEFAULTS`` when that module
is importable and has the pair, else :data:`PAPER_DEFAULTS` below, the same numbers)::

    Fashion-MNIST (3C1F)   lr     wd     damping      CIFAR-10/100 (WRN)   lr     wd     damping
    tengrad                0.003  0.001  0.1                               0.03   0.003  0.1
    kfac                   0.003  0.001  0.1                               0.03   0.003  0.03
    ekfac                  0.001  0.003  0.03                              0.01   0.003  0.03
    kbfgs                  0.03   0.01   0.01                              0.03   0.003  0.03
    sgd                    0.03   0.001  -                                 0.01   0.003  -

The CIFAR-10 values (tuned on WRN) are used for every CIFAR model and for CIFAR-100.
``--momentum`` defaults to 0.9 for all. ``--curvature-every`` defaults to 1 for TENGraD
(curvature from every batch, as in the paper's accuracy runs; pass e.g. 20 to amortize)
and does not apply to the others (K-FAC / EK-FAC / KBFGS take the registry's
``PAPER_INTERVALS``: statistics every 20 steps, inversion every 100). ``--lr-schedule``
(in epochs) defaults to ``const`` on Fashion-MNIST, ``step:10:0.5`` on CIFAR-10,
``multistep:30,45:0.1`` on CIFAR-100: ``lr(epoch e, 0-based) = lr · FACTOR^(e // EVERY)``
resp. ``lr · FACTOR^(#{Ei <= e})``; it is applied at the start of every epoch.

Optimizers are built by ``tengrad_fx.optim.registry.make_optimizer`` with every value
explicit (without the registry: ``torch.optim.SGD`` / ``tengrad_fx.TENGraD``; K-FAC,
EK-FAC and KBFGS need it). SGD gets the plain model; every other optimizer the model
prepared by :func:`tengrad_fx.prepare`; if the optimizer has ``mc_capture`` (MC Fisher)
it is called on the logits before ``loss.backward()``. ``--subset N`` trains on
``zoo.subset(train, N)`` (a fixed shuffle, seed 0, so every ``--seed`` sees the same
samples) and evaluates on ``zoo.subset(test, N)``.

Files written to ``--out`` (default ``runs/<model>-<dataset>-<optimizer>-s<seed>``)
------------------------------------------------------------------------------------
``config.json``
    every resolved argument (defaults filled in) plus ``n_params``, ``steps_per_epoch``,
    ``n_train``, ``n_test``, ``optimizer_kwargs`` (what the optimizer was built with,
    e.g. K-FAC's ``TCov``/``TInv``); nothing that differs between repeats of one experiment.
``steps.jsonl`` -- one JSON object per training step:
    ``step`` (1-based, global), ``epoch`` (1-based epoch the step belongs to),
    ``loss`` (training loss of the batch, before the update), ``acc`` (training accuracy
    of the batch, before the update), ``lr`` (learning rate used), ``train_time``
    (cumulative training wall-clock seconds, evaluation and checkpointing excluded;
    with ``--compile`` the first steps include the compilation),
    ``skipped`` (true if the update was skipped: non-finite loss, or the optimizer
    skipped it).
``epochs.jsonl`` -- one JSON object per evaluation at the end of an epoch:
    ``epoch`` (epochs completed; fractional ``e + k/steps_per_epoch`` for a run stopped
    by ``--max-steps`` inside an epoch), ``step``, ``train_loss``, ``train_acc`` (means
    over the epoch's training batches, weighted by batch size, before each update;
    batches with a non-finite loss are left out of ``train_loss``, which is ``null`` if
    all were),
    ``test_loss``, ``test_acc`` (full test set, batches of 1000, ``torch.no_grad``),
    ``lr``, ``train_time`` (cumulative, as in steps.jsonl), ``eval_time`` (cumulative
    evaluation seconds, this evaluation included).
``evals.jsonl`` (only with ``--eval-every N``) -- one object every N steps:
    ``step``, ``epoch`` (fractional), ``test_loss``, ``test_acc``, ``train_time``, ``eval_time``.
``summary.json``
    ``test_acc``, ``test_loss``, ``train_loss``, ``train_acc`` (last epoch),
    ``train_time``, ``eval_time``, ``epochs`` (completed, fractional if stopped inside an
    epoch), ``steps``, ``samples_per_s``, ``optimizer``, ``model``, ``dataset``,
    ``skipped_steps`` (= ``skipped_nonfinite_loss`` + ``skipped_by_optimizer``),
    ``stopped_by_max_steps``, ``resumed_at_steps`` (steps at which ``--resume`` picked the
    run up), ``out``, ``torch`` (version), ``device_name``, ``threads``. Written last: a
    directory without it holds an unfinished run.
``checkpoint.pt``
    after every epoch (and when ``--max-steps`` stops a run), written atomically (a
    temporary file in ``--out``, then ``os.replace``): model and optimizer state dicts,
    ``epoch``/``step``/``batch_in_epoch``, the torch RNG states, the data generator's
    state at the start of the current epoch, running epoch sums, timings, skip counts,
    the config (TENGraD's state dict carries which layers its backward materializes).
    ``--resume`` restores all of it and continues with the identical trajectory: on CPU
    the parameters are bit-identical to an uninterrupted run (TENGraD with
    ``--curvature-every`` > 1 recomputes curvature on the first step after loading,
    so only ``T = 1`` is bit-identical). The jsonl logs are cut back to the checkpoint's
    step and appended to.
``coverage.txt`` (prepared models) -- :func:`tengrad_fx.report` of the model.
``curves.png`` / ``curves.svg`` -- ``tools.plot.plot_runs`` of this run (unless ``--no-plot``).

Non-finite losses: the step's update is skipped (no backward, parameters unchanged) and
counted; optimizers with ``counters["skipped"]`` (TENGraD) also skip non-finite gradients
and failed factorizations themselves; both counts go to ``summary.json``.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["PAPER_DEFAULTS", "LR_SCHEDULE_DEFAULTS", "OPTIMIZER_NAMES", "build_parser", "lr_factor",
           "main", "parse_lr_schedule", "resolve_config", "run"]

OPTIMIZER_NAMES = ("sgd", "tengrad", "kfac", "ekfac", "kbfgs")

# method -> dataset -> {lr, weight_decay, damping}; fallback when the optimizer registry
# (tengrad_fx.optim.registry.PAPER_DEFAULTS) is not importable or lacks an entry.
_FMNIST = {
    "tengrad": dict(lr=0.003, weight_decay=0.001, damping=0.1),
    "kfac": dict(lr=0.003, weight_decay=0.001, damping=0.1),
    "ekfac": dict(lr=0.001, weight_decay=0.003, damping=0.03),
    "kbfgs": dict(lr=0.03, weight_decay=0.01, damping=0.01),
    "sgd": dict(lr=0.03, weight_decay=0.001, damping=None),
}
_CIFAR = {
    "tengrad": dict(lr=0.03, weight_decay=0.003, damping=0.1),
    "kfac": dict(lr=0.03, weight_decay=0.003, damping=0.03),
    "ekfac": dict(lr=0.01, weight_decay=0.003, damping=0.03),
    "kbfgs": dict(lr=0.03, weight_decay=0.003, damping=0.03),
    "sgd": dict(lr=0.01, weight_decay=0.003, damping=None),
}
PAPER_DEFAULTS: dict[str, dict[str, dict[str, Optional[float]]]] = {
    m: {"fashion-mnist": _FMNIST[m], "cifar10": _CIFAR[m], "cifar100": _CIFAR[m]} for m in OPTIMIZER_NAMES
}
LR_SCHEDULE_DEFAULTS = {"fashion-mnist": "const", "cifar10": "step:10:0.5", "cifar100": "multistep:30,45:0.1"}

_DATASET_ALIASES = {
    "fashion-mnist": "fashion-mnist", "fashionmnist": "fashion-mnist", "fmnist": "fashion-mnist",
    "cifar10": "cifar10", "cifar-10": "cifar10", "cifar100": "cifar100", "cifar-100": "cifar100",
}

# Arguments that determine the trajectory: --resume refuses a checkpoint whose config differs.
_TRAJECTORY_KEYS = ("model", "dataset", "optimizer", "batch_size", "lr", "momentum", "weight_decay", "damping",
                    "curvature_every", "fisher", "lr_schedule", "seed", "subset")

CHECKPOINT = "checkpoint.pt"
EVAL_BATCH = 1000


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
        prog="tengrad-train" if called.startswith("tengrad-train") else "python -m tools.train",
        description="Train a zoo model with TENGraD / SGD / K-FAC / EK-FAC / KBFGS; logs, checkpoint and "
                    "summary go to --out (see the module docstring for the log columns).",
        formatter_class=_HelpFormatter,
    )
    p.add_argument("--model", default="3c1f", help="zoo model: 3c1f, wrn-28-4, densenet-19, mobilenetv2, "
                                                   "timm:<name>, torchvision:<name>")
    p.add_argument("--dataset", default="fashion-mnist", help="fashion-mnist, cifar10 or cifar100")
    p.add_argument("--optimizer", default="tengrad", choices=OPTIMIZER_NAMES, help="optimizer")
    p.add_argument("--epochs", type=int, default=1, help="total epochs (also when resuming)")
    p.add_argument("--batch-size", type=int, default=128, help="training batch size")
    p.add_argument("--lr", type=float, default=None, help="default: paper value for (optimizer, dataset)")
    p.add_argument("--momentum", type=float, default=0.9, help="momentum (all optimizers)")
    p.add_argument("--weight-decay", type=float, default=None, help="default: paper value")
    p.add_argument("--damping", type=float, default=None, help="default: paper value (not used by sgd)")
    p.add_argument("--curvature-every", type=int, default=None,
                   help="TENGraD curvature period T in steps (default 1); kfac/ekfac/kbfgs use the paper intervals")
    p.add_argument("--fisher", choices=("empirical", "mc"), default=None,
                   help="Fisher: empirical or Monte-Carlo sampled labels (default: empirical for tengrad)")
    p.add_argument("--lr-schedule", default=None,
                   help="const | step:EVERY:FACTOR | multistep:E1,E2,...:FACTOR (epochs); default: const for "
                        "fashion-mnist, step:10:0.5 for cifar10, multistep:30,45:0.1 for cifar100")
    p.add_argument("--seed", type=int, default=0, help="model init, data order, MC sampling")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    p.add_argument("--compile", action="store_true", help="torch.compile the model's forward")
    p.add_argument("--subset", type=int, default=None, metavar="N",
                   help="train on N samples (zoo.subset, fixed seed 0) and test on N test samples")
    p.add_argument("--max-steps", "--steps-limit", dest="max_steps", type=int, default=None, metavar="N",
                   help="stop after N optimizer steps in total (smoke runs, tests); a checkpoint is written")
    p.add_argument("--out", default=None, help="output directory (default runs/<model>-<dataset>-<optimizer>-s<seed>)")
    p.add_argument("--resume", action="store_true",
                   help="continue from OUT/checkpoint.pt (starts from scratch if there is none)")
    p.add_argument("--data-dir", default=None, help="where to look for the dataset files first")
    p.add_argument("--download", action="store_true", help="allow a torchvision download of the dataset")
    p.add_argument("--eval-every", type=int, default=0, metavar="STEPS",
                   help="also evaluate every STEPS steps (evals.jsonl); 0 = only at the end of each epoch")
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (0 = leave torch's default)")
    p.add_argument("--no-progress", action="store_true", help="no tqdm bar (it is also off when stderr is no TTY)")
    p.add_argument("--no-plot", action="store_true", help="do not draw OUT/curves.png at the end")
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


def _registry() -> Optional[Any]:
    """The optimizer registry module, or None while it is not importable."""
    try:
        from tengrad_fx.optim import registry  # noqa: PLC0415
    except ImportError:
        return None
    return registry if hasattr(registry, "make_optimizer") else None


def _paper_defaults(optimizer: str, dataset: str) -> dict[str, Optional[float]]:
    reg = _registry()
    table = getattr(reg, "PAPER_DEFAULTS", None) if reg is not None else None
    entry: Optional[dict[str, Any]] = None
    if isinstance(table, dict):
        by_ds = table.get(optimizer)
        if isinstance(by_ds, dict):
            for key in (dataset, dataset.replace("cifar", "cifar-"), "cifar10" if dataset == "cifar100" else None):
                if key is not None and isinstance(by_ds.get(key), dict):
                    entry = by_ds[key]
                    break
    base = dict(PAPER_DEFAULTS[optimizer][dataset])
    if entry is not None:
        base.update({k: entry[k] for k in ("lr", "weight_decay", "damping") if k in entry})
    return base


def resolve_config(args: argparse.Namespace) -> dict[str, Any]:
    """Fill in the (optimizer, dataset) defaults and validate; a plain dict of everything."""
    cfg = dict(vars(args))
    cfg["dataset"] = canonical_dataset(args.dataset)
    cfg["model"] = args.model.strip()
    if args.optimizer not in OPTIMIZER_NAMES:
        raise ConfigError(f"unknown optimizer {args.optimizer!r}; valid: {', '.join(OPTIMIZER_NAMES)}")
    if args.optimizer not in ("sgd", "tengrad") and _registry() is None:
        raise ConfigError(f"--optimizer {args.optimizer} needs tengrad_fx.optim.registry.make_optimizer, "
                          "which is not importable in this checkout (sgd and tengrad work without it)")
    defaults = _paper_defaults(args.optimizer, cfg["dataset"])
    for key in ("lr", "weight_decay", "damping"):
        if cfg[key] is None:
            cfg[key] = defaults.get(key)
    if args.optimizer == "sgd":
        for key in ("damping", "curvature_every", "fisher"):
            if vars(args)[key] is not None:
                raise ConfigError(f"--{key.replace('_', '-')} does not apply to --optimizer sgd")
        cfg["damping"] = None
    if args.optimizer in ("kfac", "ekfac", "kbfgs") and args.curvature_every is not None:
        raise ConfigError(f"--curvature-every applies to tengrad only; {args.optimizer} uses the paper's "
                          "statistics/inversion periods (tengrad_fx.optim.registry.PAPER_INTERVALS)")
    if args.optimizer == "kbfgs" and args.fisher is not None:
        raise ConfigError("--fisher does not apply to --optimizer kbfgs")
    if args.optimizer == "tengrad":
        cfg["curvature_every"] = 1 if args.curvature_every is None else args.curvature_every
        cfg["fisher"] = "empirical" if args.fisher is None else args.fisher
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
        (cfg["curvature_every"] is None or cfg["curvature_every"] >= 1,
         f"--curvature-every must be >= 1, got {cfg['curvature_every']}"),
        (args.subset is None or args.subset >= 1, f"--subset must be >= 1, got {args.subset}"),
        (args.max_steps is None or args.max_steps >= 1, f"--max-steps must be >= 1, got {args.max_steps}"),
        (args.eval_every >= 0, f"--eval-every must be >= 0, got {args.eval_every}"),
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
    import zoo  # noqa: PLC0415

    kwargs: dict[str, Any] = {}
    if name.lower() == "3c1f" and dataset.x.shape[-1] != 28:
        kwargs["img_size"] = int(dataset.x.shape[-1])
    return zoo.get_model(name, num_classes=dataset.num_classes, in_chans=int(dataset.x.shape[1]), **kwargs)


def optimizer_kwargs(cfg: dict[str, Any]) -> dict[str, Any]:
    """Keyword arguments of the optimizer: lr, momentum, weight_decay, damping (not SGD),
    curvature_every / fisher where set, and the registry's ``PAPER_INTERVALS`` (K-FAC,
    EK-FAC, KBFGS statistics/inversion periods) when it has them."""
    name = cfg["optimizer"]
    kw: dict[str, Any] = dict(lr=cfg["lr"], momentum=cfg["momentum"], weight_decay=cfg["weight_decay"])
    if name != "sgd":
        kw["damping"] = cfg["damping"]
        for key in ("curvature_every", "fisher"):
            if cfg[key] is not None:
                kw[key] = cfg[key]
    reg = _registry()
    intervals = getattr(reg, "PAPER_INTERVALS", {}) if reg is not None else {}
    if isinstance(intervals, dict) and isinstance(intervals.get(name), dict):
        kw = {**intervals[name], **kw}
    return kw


def build_optimizer(cfg: dict[str, Any], model: nn.Module) -> torch.optim.Optimizer:
    """SGD over the plain model; any other optimizer over the prepared model. Through
    ``tengrad_fx.optim.registry.make_optimizer`` when importable (every value explicit)."""
    name = cfg["optimizer"]
    kw = optimizer_kwargs(cfg)
    reg = _registry()
    try:
        if reg is not None:
            return reg.make_optimizer(name, model, **kw)
        if name == "sgd":
            return torch.optim.SGD(model.parameters(), **kw)
        if name == "tengrad":
            from tengrad_fx import TENGraD  # noqa: PLC0415

            return TENGraD(model, **kw)
    except TypeError as exc:  # an option this optimizer does not take
        raise ConfigError(f"--optimizer {name}: {exc}") from exc
    raise ConfigError(f"--optimizer {name} needs tengrad_fx.optim.registry (not importable)")


def evaluate(model: nn.Module, dataset: Any, batch_size: int = EVAL_BATCH,
             progress: bool = False) -> tuple[float, float]:
    """(mean cross-entropy, accuracy) over ``dataset`` under ``torch.no_grad`` in eval mode."""
    import zoo  # noqa: PLC0415

    was_training = model.training
    model.eval()
    loss_sum, correct, n = 0.0, 0, 0
    bar = _progress(zoo.num_batches(dataset, batch_size), "eval", not progress, leave=False)
    try:
        with torch.no_grad():
            for xb, yb in zoo.batches(dataset, batch_size):
                out = model(xb)
                loss_sum += float(F.cross_entropy(out.float(), yb, reduction="sum"))
                correct += int((out.argmax(-1) == yb).sum())
                n += int(yb.shape[0])
                bar.update(1)
    finally:
        bar.close()
        model.train(was_training)
    return loss_sum / max(n, 1), correct / max(n, 1)


def save_checkpoint(path: Path, obj: dict[str, Any]) -> None:
    """``torch.save`` to a temporary file next to ``path``, then ``os.replace`` (atomic)."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _truncate_jsonl(path: Path, keep: Callable[[dict[str, Any]], bool]) -> None:
    """Keep only the lines of a jsonl log that satisfy ``keep`` (used on resume)."""
    if not path.exists():
        return
    kept = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue  # a half-written last line of a killed run
        if keep(rec):
            kept.append(line)
    path.write_text("".join(f"{line}\n" for line in kept))


class _JsonlLog:
    def __init__(self, path: Path):
        self.path = path
        self._f = open(path, "a")

    def write(self, rec: dict[str, Any]) -> None:
        self._f.write(json.dumps(rec) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()


def _skipped_by_optimizer(opt: torch.optim.Optimizer) -> int:
    counters = getattr(opt, "counters", None)
    if isinstance(counters, dict):
        return int(counters.get("skipped", 0))
    return 0


def _progress(total: int, desc: str, disable: bool, leave: bool = True) -> Any:
    from tqdm.auto import tqdm  # noqa: PLC0415

    return tqdm(total=total, desc=desc, disable=disable, dynamic_ncols=True, leave=leave, file=sys.stderr)


def _skip_batches(it: Iterator[Any], k: int) -> None:
    for _ in range(k):
        next(it)


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
    return _train(cfg, parser)


def _train(cfg: dict[str, Any], parser: argparse.ArgumentParser) -> dict[str, Any]:
    import zoo  # noqa: PLC0415

    if cfg["threads"]:
        torch.set_num_threads(cfg["threads"])
    device = torch.device(cfg["device"])
    out = Path(cfg["out"])
    ckpt_path = out / CHECKPOINT

    # ---- resume: load the checkpoint first, so a config mismatch fails before any work
    ckpt: Optional[dict[str, Any]] = None
    if cfg["resume"]:
        if ckpt_path.exists():
            ckpt = torch.load(ckpt_path, map_location="cpu", weights_only=False)
            old = ckpt["config"]
            diff = [f"{k}: checkpoint {old.get(k)!r} vs now {cfg[k]!r}" for k in _TRAJECTORY_KEYS
                    if old.get(k) != cfg[k]]
            if diff:
                parser.error(f"--resume: {ckpt_path} was written with a different configuration: " + "; ".join(diff))
        else:
            print(f"--resume: no {ckpt_path}, starting from scratch", file=sys.stderr)

    # ---- data and model
    try:
        train_ds = zoo.get_dataset(cfg["dataset"], "train", cfg["data_dir"], download=cfg["download"])
        test_ds = zoo.get_dataset(cfg["dataset"], "test", cfg["data_dir"], download=cfg["download"])
    except (FileNotFoundError, ValueError) as exc:
        parser.error(str(exc))
    if cfg["subset"] is not None:
        train_ds = zoo.subset(train_ds, cfg["subset"])
        test_ds = zoo.subset(test_ds, cfg["subset"])
    train_ds, test_ds = train_ds.to(device), test_ds.to(device)

    torch.manual_seed(cfg["seed"])
    try:
        model = build_model(cfg["model"], train_ds).to(device)
    except (ValueError, TypeError) as exc:
        parser.error(f"--model {cfg['model']}: {exc}")
    n_params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    coverage = None
    if cfg["optimizer"] != "sgd":
        import tengrad_fx  # noqa: PLC0415

        model = tengrad_fx.prepare(model, example_inputs=(train_ds.x[:2],))
        coverage = str(tengrad_fx.report(model, m=cfg["batch_size"]))
    try:
        opt = build_optimizer(cfg, model)
    except ConfigError as exc:
        parser.error(str(exc))
    forward: Callable[[torch.Tensor], torch.Tensor] = torch.compile(model) if cfg["compile"] else model
    out.mkdir(parents=True, exist_ok=True)  # only now: a bad --model/--dataset leaves no directory behind
    gen = torch.Generator().manual_seed(cfg["seed"])  # data order (+ augmentation), always on the CPU
    steps_per_epoch = zoo.num_batches(train_ds, cfg["batch_size"])
    base_lr = cfg["lr"]

    # ---- state (fresh or from the checkpoint)
    epoch, step, batch_in_epoch = 0, 0, 0
    train_time = eval_time = 0.0
    skipped_loss = 0
    ep_loss_sum = ep_loss_n = ep_correct = ep_count = 0.0  # running sums of the current epoch
    samples = 0
    epoch_gen_state = gen.get_state()
    if ckpt is not None:
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optimizer"])
        epoch, step, batch_in_epoch = ckpt["epoch"], ckpt["step"], ckpt["batch_in_epoch"]
        train_time, eval_time = ckpt["train_time"], ckpt["eval_time"]
        skipped_loss = ckpt["skipped_nonfinite_loss"]
        ep_loss_sum, ep_loss_n, ep_correct, ep_count = ckpt["epoch_sums"]
        samples = ckpt["samples"]
        epoch_gen_state = ckpt["rng"]["data_epoch_start"]
        torch.set_rng_state(ckpt["rng"]["torch"])
        if device.type == "cuda" and ckpt["rng"].get("cuda") is not None:
            torch.cuda.set_rng_state(ckpt["rng"]["cuda"], device)
        last_step = step
        for name in ("steps.jsonl", "evals.jsonl", "epochs.jsonl"):
            _truncate_jsonl(out / name, lambda r: r.get("step", 0) <= last_step)
        with contextlib.suppress(FileNotFoundError):
            (out / "summary.json").unlink()  # the run is unfinished again until the new summary
    else:
        for name in ("steps.jsonl", "evals.jsonl", "epochs.jsonl", "summary.json", CHECKPOINT):
            with contextlib.suppress(FileNotFoundError):
                (out / name).unlink()

    resolved = {k: v for k, v in cfg.items() if k != "resume"}
    meta = dict(resolved, resume=cfg["resume"], n_params=n_params, steps_per_epoch=steps_per_epoch,
                n_train=len(train_ds), n_test=len(test_ds), optimizer_kwargs=optimizer_kwargs(cfg))
    (out / "config.json").write_text(json.dumps(meta, indent=2) + "\n")
    resumed_at = list(ckpt.get("resumed_at", [])) + [step] if ckpt is not None else []
    if coverage is not None:
        (out / "coverage.txt").write_text(coverage + "\n")

    steps_log, epochs_log = _JsonlLog(out / "steps.jsonl"), _JsonlLog(out / "epochs.jsonl")
    evals_log = _JsonlLog(out / "evals.jsonl") if cfg["eval_every"] else None
    show = not cfg["no_progress"] and sys.stderr.isatty()
    last_eval: Optional[dict[str, Any]] = None
    max_steps = cfg["max_steps"]
    stopped = False

    def snapshot() -> dict[str, Any]:
        return {
            "model": model.state_dict(),
            "optimizer": opt.state_dict(),
            "epoch": epoch,
            "step": step,
            "batch_in_epoch": batch_in_epoch,
            "train_time": train_time,
            "eval_time": eval_time,
            "skipped_nonfinite_loss": skipped_loss,
            "epoch_sums": (ep_loss_sum, ep_loss_n, ep_correct, ep_count),
            "samples": samples,
            "rng": {"torch": torch.get_rng_state(),
                    "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
                    "data_epoch_start": epoch_gen_state},
            "config": resolved,
            "resumed_at": resumed_at,
        }

    def do_eval() -> tuple[float, float]:
        nonlocal eval_time
        t0 = time.perf_counter()
        loss, acc = evaluate(forward_eval, test_ds, progress=show)
        eval_time += time.perf_counter() - t0
        return loss, acc

    forward_eval = forward
    session_samples, session_t0 = 0, train_time
    model.train()
    try:
        while epoch < cfg["epochs"] and not (max_steps is not None and step >= max_steps):
            lr = base_lr * lr_factor(cfg["lr_schedule"], epoch)
            for group in opt.param_groups:
                group["lr"] = lr
            gen.set_state(epoch_gen_state)
            it = zoo.batches(train_ds, cfg["batch_size"], shuffle=True, generator=gen)
            _skip_batches(it, batch_in_epoch)
            bar = _progress(steps_per_epoch, f"epoch {epoch + 1}/{cfg['epochs']}", not show)
            bar.update(batch_in_epoch)
            while True:
                if max_steps is not None and step >= max_steps:
                    stopped = True
                    break
                t0 = time.perf_counter()
                try:
                    xb, yb = next(it)
                except StopIteration:
                    break
                out_logits = forward(xb)
                loss = F.cross_entropy(out_logits, yb)
                loss_v = float(loss.detach())
                before = _skipped_by_optimizer(opt)
                opt.zero_grad(set_to_none=True)
                if math.isfinite(loss_v):
                    if hasattr(opt, "mc_capture"):
                        opt.mc_capture(out_logits)
                    loss.backward()
                    opt.step()
                    skipped = _skipped_by_optimizer(opt) > before
                else:
                    skipped_loss += 1
                    skipped = True
                correct = int((out_logits.detach().argmax(-1) == yb).sum())
                train_time += time.perf_counter() - t0
                del out_logits, loss
                bs = int(yb.shape[0])
                step += 1
                batch_in_epoch += 1
                if math.isfinite(loss_v):
                    ep_loss_sum += loss_v * bs
                    ep_loss_n += bs
                ep_correct += correct
                ep_count += bs
                samples += bs
                steps_log.write({"step": step, "epoch": epoch + 1, "loss": loss_v, "acc": correct / bs, "lr": lr,
                                 "train_time": train_time, "skipped": skipped})
                session_samples += bs
                bar.set_postfix(loss=f"{ep_loss_sum / max(ep_loss_n, 1):.4f}",
                                acc=f"{ep_correct / max(ep_count, 1):.3f}",
                                samples_s=f"{session_samples / max(train_time - session_t0, 1e-9):.0f}", refresh=False)
                bar.update(1)
                if evals_log is not None and step % cfg["eval_every"] == 0:
                    test_loss, test_acc = do_eval()
                    last_eval = {"step": step, "epoch": epoch + batch_in_epoch / steps_per_epoch,
                                 "test_loss": test_loss, "test_acc": test_acc, "train_time": train_time,
                                 "eval_time": eval_time}
                    evals_log.write(last_eval)
            bar.close()
            complete = batch_in_epoch >= steps_per_epoch
            if not complete and batch_in_epoch == 0:
                break  # stopped by --max-steps exactly at an epoch boundary: nothing new to log
            test_loss, test_acc = do_eval()
            frac_epoch: float = epoch + 1 if complete else epoch + batch_in_epoch / steps_per_epoch
            train_loss = ep_loss_sum / ep_loss_n if ep_loss_n else None  # None: every loss was non-finite
            rec = {"epoch": frac_epoch, "step": step, "train_loss": train_loss,
                   "train_acc": ep_correct / max(ep_count, 1), "test_loss": test_loss, "test_acc": test_acc,
                   "lr": lr, "train_time": train_time, "eval_time": eval_time}
            epochs_log.write(rec)
            last_eval = dict(rec)
            print(f"epoch {frac_epoch:g}: train loss {train_loss if train_loss is not None else float('nan'):.4f} "
                  f"acc {rec['train_acc']:.4f} | "
                  f"test loss {test_loss:.4f} acc {test_acc:.4f} | train {train_time:.1f}s eval {eval_time:.1f}s",
                  flush=True)
            if complete:
                epoch += 1
                batch_in_epoch = 0
                ep_loss_sum = ep_loss_n = ep_correct = ep_count = 0.0
                epoch_gen_state = gen.get_state()
            save_checkpoint(ckpt_path, snapshot())
            if stopped:
                break
    finally:
        steps_log.close()
        epochs_log.close()
        if evals_log is not None:
            evals_log.close()

    if last_eval is None or last_eval["step"] != step:  # nothing trained now, or stopped at a boundary
        test_loss, test_acc = do_eval()
        last_eval = {"test_loss": test_loss, "test_acc": test_acc, "step": step}
        prev = [json.loads(x) for x in (out / "epochs.jsonl").read_text().splitlines() if x.strip()]
        if prev:
            last_eval.setdefault("train_loss", prev[-1]["train_loss"])
            last_eval.setdefault("train_acc", prev[-1]["train_acc"])
    skipped_opt = _skipped_by_optimizer(opt)
    stopped = max_steps is not None and step >= max_steps and epoch < cfg["epochs"]
    summary = {
        "test_acc": last_eval["test_acc"], "test_loss": last_eval["test_loss"],
        "train_loss": last_eval.get("train_loss"), "train_acc": last_eval.get("train_acc"),
        "train_time": train_time, "eval_time": eval_time,
        "epochs": epoch + batch_in_epoch / steps_per_epoch, "steps": step,
        "samples_per_s": (samples / train_time) if train_time > 0 else None,
        "optimizer": cfg["optimizer"], "model": cfg["model"], "dataset": cfg["dataset"],
        "skipped_steps": skipped_loss + skipped_opt, "skipped_nonfinite_loss": skipped_loss,
        "skipped_by_optimizer": skipped_opt, "stopped_by_max_steps": stopped, "resumed_at_steps": resumed_at,
        "out": str(out), "torch": torch.__version__,
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "threads": torch.get_num_threads(),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")

    plot_msg = ""
    if not cfg["no_plot"]:
        try:
            from tools.plot import plot_runs  # noqa: PLC0415

            plot_runs([str(out)], str(out / "curves.png"))
            plot_msg = f", plot {out / 'curves.png'}"
        except ImportError as exc:
            if "matplotlib" in str(exc):
                print("note: no curves.png (install matplotlib, e.g. pip install -e '.[plot]')", file=sys.stderr)
        except Exception as exc:  # a plotting problem must not lose a finished run
            print(f"warning: plotting failed ({type(exc).__name__}: {exc})", file=sys.stderr)
    skipped_txt = f", {summary['skipped_steps']} skipped steps" if summary["skipped_steps"] else ""
    print(f"{cfg['model']} / {cfg['dataset']} / {cfg['optimizer']}: test accuracy {summary['test_acc']:.4f} "
          f"(loss {summary['test_loss']:.4f}) after {step} steps ({summary['epochs']:g} epochs){skipped_txt}; "
          f"train time {train_time:.1f} s, eval time {eval_time:.1f} s")
    print(f"logs: {out}/{{config.json,steps.jsonl,epochs.jsonl,summary.json}}, checkpoint {ckpt_path}{plot_msg}")
    return summary


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Console entry point (``tengrad-train``, ``python -m tools.train``)."""
    run(argv)


if __name__ == "__main__":
    main()
