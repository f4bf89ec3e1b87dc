"""Optimizers over a prepared model: :mod:`.tengrad` (TENGraD), :mod:`.baselines` (KFAC,
EKFAC, KBFGS, NGD), the step they share (:mod:`.step`) and the paper's settings
(:mod:`.registry`)."""
from .baselines import EKFAC, KBFGS, KFAC, NGD
from .registry import OPTIMIZERS, PAPER_DEFAULTS, PAPER_INTERVALS, make_optimizer
from .step.result import StepResult
from .tengrad import CurvatureSchedule, Execution, Metric, SingleProcess, TENGraD

__all__ = ["TENGraD", "CurvatureSchedule", "Execution", "Metric", "SingleProcess", "StepResult",
           "KFAC", "EKFAC", "KBFGS", "NGD", "OPTIMIZERS", "PAPER_DEFAULTS",
           "PAPER_INTERVALS", "make_optimizer"]
