"""tengrad_fx — TENGraD natural gradient with exact Fisher-block inversion.

Layers of the package (imports run one way): ``capture`` (the FX pass and the capture
ops) → ``curvature`` (Gram, Jv, Jᵀc per layer kind) → ``solve`` → ``optim``.
"""
from .capture import PrepareInfo, capturing, get_info, prepare
from .capture.unprepare import unprepare
from .curvature import CoveredLayer, covered_layers
from .optim import EKFAC, KBFGS, KFAC, NGD, CurvatureSchedule, Execution, Metric, SingleProcess, StepResult, \
    TENGraD, make_optimizer
from .report import Report, report

__all__ = ["prepare", "unprepare", "capturing", "covered_layers", "report", "Report", "CoveredLayer",
           "PrepareInfo", "get_info", "TENGraD", "CurvatureSchedule", "Execution", "Metric", "SingleProcess",
           "StepResult",
           "KFAC", "EKFAC", "KBFGS", "NGD", "make_optimizer"]
__version__ = "0.1.0"
