"""The paper's baselines: KFAC, EKFAC, KBFGS and exact NGD (small models), over the
shared :class:`~tengrad_fx.optim.baselines._common.CurvatureOptimizer`."""
from .ekfac import EKFAC
from .kbfgs import KBFGS
from .kfac import KFAC
from .ngd import NGD

__all__ = ["KFAC", "EKFAC", "KBFGS", "NGD"]
