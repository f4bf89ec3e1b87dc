"""Optimizers by name, with the TENGraD paper's tuned hyper-parameters.

``make_optimizer(name, model, dataset=None, **overrides)`` builds any of
``OPTIMIZERS`` over a prepared model (``"sgd"`` takes any model). With ``dataset``
(``"fashion-mnist"``: 3C1F, ``"cifar10"``: WideResNet) it starts from
``PAPER_DEFAULTS[name][dataset]`` (``lr``, ``weight_decay``, ``damping``), momentum 0.9 and
the paper's statistics intervals (``PAPER_INTERVALS``: TCov = TScal = 20, TInv = 100);
``overrides`` win.
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from ._common import check_nonneg, check_unit
from .ekfac import EKFAC
from .kbfgs import KBFGS
from .kfac import KFAC
from .ngd import NGD
from .tengrad import TENGraD

__all__ = ["OPTIMIZERS", "PAPER_DEFAULTS", "PAPER_INTERVALS", "PAPER_MOMENTUM", "SGD", "make_optimizer"]


class SGD(torch.optim.SGD):
    """SGD with heavy-ball momentum over ``model.parameters()`` — the same update rule as
    the other optimizers' fallback: ``d = g + λw``, ``buf = μ·buf + d``, ``w ← w − lr·buf``.
    ``damping`` is accepted and ignored, so every method takes the same keywords."""

    def __init__(self, model: torch.nn.Module, lr: float, momentum: float = 0.9,
                 weight_decay: float = 0.0, damping: Optional[float] = None):
        check_nonneg("lr", lr)
        check_unit("momentum", momentum)
        check_nonneg("weight_decay", weight_decay)
        super().__init__([p for p in model.parameters() if p.requires_grad], lr=lr,
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

PAPER_DEFAULTS: dict[str, dict[str, dict[str, float]]] = {
    # method: dataset: tuned (lr, weight decay, damping) of the paper's experiments
    "tengrad": {
        "fashion-mnist": {"lr": 0.003, "weight_decay": 0.001, "damping": 0.1},
        "cifar10": {"lr": 0.03, "weight_decay": 0.003, "damping": 0.1},
    },
    "kfac": {
        "fashion-mnist": {"lr": 0.003, "weight_decay": 0.001, "damping": 0.1},
        "cifar10": {"lr": 0.03, "weight_decay": 0.003, "damping": 0.03},
    },
    "ekfac": {
        "fashion-mnist": {"lr": 0.001, "weight_decay": 0.003, "damping": 0.03},
        "cifar10": {"lr": 0.01, "weight_decay": 0.003, "damping": 0.03},
    },
    "kbfgs": {
        "fashion-mnist": {"lr": 0.03, "weight_decay": 0.01, "damping": 0.01},
        "cifar10": {"lr": 0.03, "weight_decay": 0.003, "damping": 0.03},
    },
    "sgd": {
        "fashion-mnist": {"lr": 0.03, "weight_decay": 0.001},
        "cifar10": {"lr": 0.01, "weight_decay": 0.003},
    },
}

PAPER_INTERVALS: dict[str, dict[str, int]] = {
    "kfac": {"TCov": 20, "TInv": 100},
    "ekfac": {"TCov": 20, "TScal": 20, "TInv": 100},
    "kbfgs": {"TCov": 20, "TInv": 100},
}


def make_optimizer(name: str, model: torch.nn.Module, dataset: Optional[str] = None,
                   **overrides: Any) -> torch.optim.Optimizer:
    """``OPTIMIZERS[name](model, **settings)``; see the module docstring."""
    if name not in OPTIMIZERS:
        raise ValueError(f"name must be one of {sorted(OPTIMIZERS)}, got {name!r}")
    kw: dict[str, Any] = {}
    if dataset is not None:
        table = PAPER_DEFAULTS.get(name)
        if table is None:
            raise ValueError(f"dataset: no paper defaults for {name!r} (methods with defaults: "
                             f"{sorted(PAPER_DEFAULTS)})")
        if dataset not in table:
            raise ValueError(f"dataset must be one of {sorted(table)}, got {dataset!r}")
        kw.update(table[dataset], momentum=PAPER_MOMENTUM, **PAPER_INTERVALS.get(name, {}))
    kw.update(overrides)
    return OPTIMIZERS[name](model, **kw)
