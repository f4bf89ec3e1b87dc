"""Optimizers over a prepared model."""
from .tengrad import TENGraD

__all__ = ["TENGraD"]
