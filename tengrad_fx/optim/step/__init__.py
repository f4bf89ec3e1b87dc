"""The step every optimizer of :mod:`tengrad_fx.optim` shares: the skeleton (capture
switching, finiteness, AMP, the KL clip, momentum, state checks) around an optimizer's
``{param: u}``, and the MC Fisher's label sampling."""
from .skeleton import SkipStep, StepSkeleton

__all__ = ["SkipStep", "StepSkeleton"]
