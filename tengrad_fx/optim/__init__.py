"""Optimizers over a prepared model."""
from .ekfac import EKFAC
from .kbfgs import KBFGS
from .kfac import KFAC
from .ngd import NGD
from .registry import OPTIMIZERS, PAPER_DEFAULTS, PAPER_INTERVALS, make_optimizer
from .tengrad import TENGraD

__all__ = ["TENGraD", "KFAC", "EKFAC", "KBFGS", "NGD", "OPTIMIZERS", "PAPER_DEFAULTS",
           "PAPER_INTERVALS", "make_optimizer"]
