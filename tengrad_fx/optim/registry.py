"""Optimizers by name, with the TENGraD paper's tuned hyper-parameters.

``make_optimizer(name, model, dataset=None, **overrides)`` builds any of
``OPTIMIZERS`` over a prepared model (``"sgd"`` takes any model). With ``dataset``
(``"fashion-mnist"``, ``"cifar10"``, ``"cifar100"``) and ``model_name`` (a zoo name of the
paper's models, ``PAPER_MODELS``; default 3c1f, resp. wrn-28-4) it starts from the paper's
settings (:func:`paper_settings`):

* ``PAPER_DEFAULTS[name][dataset][model_name]``: the appendix's tuned ``lr``,
  ``weight_decay``, ``damping``; momentum 0.9;
* ``PAPER_INTERVALS``: TENGraD's curvature every 100 steps; K-FAC / EK-FAC / KBFGS
  statistics every 20 steps (``curvature_every``; EK-FAC rescaling every 20,
  ``rescale_every``), inversion every 100 (``inverse_every``);
* ``PAPER_OPTIONS``: MC Fisher (one sampled label per example, drawn by the optimizer)
  for TENGraD, K-FAC, EK-FAC, and KL clip 0.01 for all four (the authors' code).

``paper=True`` is ``dataset="fashion-mnist"`` when no dataset is named. ``preset`` (a key of
``PRESETS[name]``, e.g. TENGraD's ``"fast"``) starts from the paper's settings of the dataset
(default Fashion-MNIST) and puts the preset's options on top. ``overrides`` win; they may
use an optimizer's deprecated option names or spellings (e.g. K-FAC's ``TCov``, TENGraD's
``schedule=``), with the optimizer's ``DeprecationWarning``.
"""
from __future__ import annotations

from typing import Any, Iterable, Optional

import torch

from .baselines import EKFAC, KBFGS, KFAC, NGD
from .step.checks import check_nonneg, check_unit
from .step.renamed import respell_of
from .tengrad import TENGraD

__all__ = ["OPTIMIZERS", "PRESETS", "PAPER_DEFAULTS", "PAPER_EPOCHS", "PAPER_FASHION", "PAPER_INTERVALS",
           "PAPER_KL_CLIP", "PAPER_LR_SCHEDULES", "PAPER_MODELS", "PAPER_MOMENTUM", "PAPER_OPTIONS", "SGD",
           "make_optimizer", "paper_settings"]


class SGD(torch.optim.SGD):
    """SGD with heavy-ball momentum over ``model.parameters()`` — the same update rule as
    the other optimizers' fallback: ``d = g + λw``, ``buf = μ·buf + d``, ``w ← w − lr·buf``.
    ``damping`` is accepted and ignored, so every method takes the same keywords; ``params``
    (parameters or param group dicts) as the other optimizers'."""

    def __init__(self, model: torch.nn.Module, lr: float, momentum: float = 0.9,
                 weight_decay: float = 0.0, damping: Optional[float] = None,
                 params: Optional[Iterable[Any]] = None):
        check_nonneg("lr", lr)
        check_unit("momentum", momentum)
        check_nonneg("weight_decay", weight_decay)
        super().__init__([p for p in model.parameters() if p.requires_grad] if params is None else params, lr=lr,
                         momentum=momentum, weight_decay=weight_decay)
        self.model = model


OPTIMIZERS: dict[str, type] = {
    "tengrad": TENGraD,
    "kfac": KFAC,
    "ekfac": EKFAC,
    "kbfgs": KBFGS,
    "ngd": NGD,
    "sgd": SGD,
}

PAPER_MOMENTUM = 0.9

# The paper's models per dataset (zoo names); the first is used when no model is named.
PAPER_MODELS: dict[str, tuple[str, ...]] = {
    "fashion-mnist": ("3c1f",),
    "cifar10": ("wrn-28-4", "densenet-19", "mobilenetv2"),
    "cifar100": ("wrn-28-4", "densenet-19", "mobilenetv2"),
}


def _rows(*values: tuple[float, ...]) -> dict[str, dict[str, float]]:
    """``(lr, wd[, damping])`` per model of a CIFAR table row, in ``PAPER_MODELS`` order."""
    keys = ("lr", "weight_decay", "damping")
    return {model: dict(zip(keys, v)) for model, v in zip(PAPER_MODELS["cifar10"], values)}


# method -> dataset -> model -> tuned (lr, weight decay, damping): the paper's appendix tables
# (Fashion-MNIST: 3C1F; CIFAR-10 / CIFAR-100: WideResNet-28-4, DenseNet-19, MobileNetV2).
PAPER_DEFAULTS: dict[str, dict[str, dict[str, dict[str, float]]]] = {
    "tengrad": {
        "fashion-mnist": {"3c1f": {"lr": 0.003, "weight_decay": 0.001, "damping": 0.1}},
        "cifar10": _rows((0.03, 0.003, 0.1), (0.1, 0.003, 0.2), (0.01, 0.01, 0.2)),
        "cifar100": _rows((0.01, 0.03, 0.3), (0.1, 0.003, 0.1), (0.01, 0.01, 0.3)),
    },
    "kfac": {
        "fashion-mnist": {"3c1f": {"lr": 0.003, "weight_decay": 0.001, "damping": 0.1}},
        "cifar10": _rows((0.03, 0.003, 0.03), (0.01, 0.003, 0.03), (0.01, 0.003, 0.1)),
        "cifar100": _rows((0.003, 0.01, 0.03), (0.01, 0.003, 0.03), (0.01, 0.003, 0.03)),
    },
    "ekfac": {
        "fashion-mnist": {"3c1f": {"lr": 0.001, "weight_decay": 0.003, "damping": 0.03}},
        "cifar10": _rows((0.01, 0.003, 0.03), (0.01, 0.003, 0.01), (0.01, 0.003, 0.1)),
        "cifar100": _rows((0.003, 0.01, 0.03), (0.01, 0.003, 0.03), (0.01, 0.003, 0.03)),
    },
    "kbfgs": {
        "fashion-mnist": {"3c1f": {"lr": 0.03, "weight_decay": 0.01, "damping": 0.01}},
        "cifar10": _rows((0.03, 0.003, 0.03), (0.01, 0.003, 0.01), (0.01, 0.03, 0.03)),
        "cifar100": _rows((0.003, 0.01, 0.01), (0.01, 0.003, 0.03), (0.03, 0.01, 0.03)),
    },
    "sgd": {
        "fashion-mnist": {"3c1f": {"lr": 0.03, "weight_decay": 0.001}},
        "cifar10": _rows((0.01, 0.003), (0.03, 0.003), (0.01, 0.003)),
        "cifar100": _rows((0.01, 0.003), (0.01, 0.003), (0.01, 0.003)),
    },
}

# Curvature periods of the paper's runs: TENGraD inverts every 100 steps ("frequency of
# inversion of 100"); the K-FAC-family baselines take statistics every 20 steps, rescale
# (EK-FAC) every 20 and invert every 100.
PAPER_INTERVALS: dict[str, dict[str, int]] = {
    "tengrad": {"curvature_every": 100},
    "kfac": {"curvature_every": 20, "inverse_every": 100},
    "ekfac": {"curvature_every": 20, "rescale_every": 20, "inverse_every": 100},
    "kbfgs": {"curvature_every": 20, "inverse_every": 100},
}

# Fisher and KL clip of the authors' code (a K-FAC codebase): one label sampled per example
# from softmax(outputs) on curvature steps ("true" / MC Fisher; KBFGS has no Fisher), and
# kl_clip = 0.01 (its main.py default, not overridden by the Fashion-MNIST scripts).
PAPER_KL_CLIP = 0.01
PAPER_OPTIONS: dict[str, dict[str, Any]] = {
    "tengrad": {"fisher": "mc", "kl_clip": PAPER_KL_CLIP},
    "kfac": {"fisher": "mc", "kl_clip": PAPER_KL_CLIP},
    "ekfac": {"fisher": "mc", "kl_clip": PAPER_KL_CLIP},
    "kbfgs": {"kl_clip": PAPER_KL_CLIP},
}

# lr schedules of the paper's protocol (epochs, 0-based): Fashion-MNIST 10 epochs constant;
# CIFAR-10 60 epochs, halved every 10; CIFAR-100 60 epochs, ×0.1 at 30 and 45.
PAPER_EPOCHS: dict[str, int] = {"fashion-mnist": 10, "cifar10": 60, "cifar100": 60}
PAPER_LR_SCHEDULES: dict[str, str] = {"fashion-mnist": "const", "cifar10": "step:10:0.5",
                                      "cifar100": "multistep:30,45:0.1"}


PAPER_FASHION = "fashion-mnist"  # the paper's headline benchmark: the dataset of paper=True and of presets

# Named option sets on top of the paper's settings (``make_optimizer(..., preset=...)``).
# TENGraD "fast": the best of the options screened on 3C1F / Fashion-MNIST (docs/ablations.md:
# faster than the paper's settings over the first 75 steps, still behind Muon there);
# "orthogonal": the weights' NGD updates orthogonalized (Muon's direction), RMSProp-grafted biases;
# "lm": "fast" for language models (docs/workloads.md): one row of J per token (512 drawn per
# curvature step, every 40 steps), the factored base metric, no KL clip.
PRESETS: dict[str, dict[str, dict[str, Any]]] = {
    "tengrad": {"fast": {"graft": "rmsprop", "lr": 3e-4, "damping": 0.01},
                "orthogonal": {"graft": "rmsprop", "orthogonalize": "eigh", "lr": 1e-3},
                "lm": {"graft": "rmsprop", "lr": 3e-4, "damping": 0.01, "kl_clip": None, "metric": "factored",
                       "position_rows": 512, "curvature_every": 40}},
}


def paper_settings(name: str, dataset: str, model_name: Optional[str] = None) -> dict[str, Any]:
    """Every keyword the paper's run of method ``name`` on (``dataset``, ``model_name``)
    used: tuned lr / weight decay / damping, momentum 0.9, the curvature intervals, the
    Fisher and the KL clip. ``model_name=None`` takes the dataset's first paper model
    (``PAPER_MODELS``: 3c1f, resp. wrn-28-4)."""
    table = PAPER_DEFAULTS.get(name)
    if table is None:
        raise ValueError(f"dataset: no paper defaults for {name!r} (methods with defaults: {sorted(PAPER_DEFAULTS)})")
    if dataset not in table:
        raise ValueError(f"dataset must be one of {sorted(table)}, got {dataset!r}")
    models = table[dataset]
    key = PAPER_MODELS[dataset][0] if model_name is None else model_name.strip().lower()
    if key not in models:
        raise ValueError(f"model_name: the paper has no {dataset} row for {model_name!r}; rows: {sorted(models)} "
                         "(pass lr / weight_decay / damping explicitly for other models)")
    return dict(models[key], momentum=PAPER_MOMENTUM, **PAPER_INTERVALS.get(name, {}), **PAPER_OPTIONS.get(name, {}))


def make_optimizer(name: str, model: torch.nn.Module, dataset: Optional[str] = None,
                   model_name: Optional[str] = None, *, paper: bool = False, preset: Optional[str] = None,
                   **overrides: Any) -> torch.optim.Optimizer:
    """``OPTIMIZERS[name](model, **settings)``; with ``dataset`` (or ``paper=True`` / a
    ``preset``: Fashion-MNIST unless ``dataset`` says otherwise) the settings start from
    :func:`paper_settings` (``name``, ``dataset``, ``model_name``), then ``PRESETS[name][preset]``;
    ``overrides`` win. Without any of them, the optimizer's own (library) defaults apply.
    Deprecated option names and spellings in ``overrides`` are translated first
    (``DeprecationWarning``), so they replace the paper's value under the new name; old and
    new together: an error (``TypeError`` for a renamed option, ``ValueError`` for TENGraD's)."""
    if name not in OPTIMIZERS:
        raise ValueError(f"name must be one of {sorted(OPTIMIZERS)}, got {name!r}")
    presets = PRESETS.get(name, {})
    if preset is not None and preset not in presets:
        raise ValueError(f"preset: {name!r} has presets {sorted(presets)}, got {preset!r}")
    if dataset is None and (paper or preset is not None):
        dataset = PAPER_FASHION
    kw: dict[str, Any] = paper_settings(name, dataset, model_name) if dataset is not None else {}
    kw.update(presets.get(preset, {}) if preset is not None else {})
    cls = OPTIMIZERS[name]
    kw.update(respell_of(cls, overrides))
    return cls(model, **kw)
