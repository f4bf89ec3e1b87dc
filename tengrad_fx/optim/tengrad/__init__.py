"""TENGraD and its internals: layer groups, their build and cost model, the push-through
probe, the fused (compilable) curvature step, CUDA graphs and the curvature's resume."""
from .distribution import SingleProcess
from .metric import Metric
from .options import Execution
from .schedule import CurvatureSchedule
from .tengrad import TENGraD

__all__ = ["TENGraD", "CurvatureSchedule", "Execution", "Metric", "SingleProcess"]
