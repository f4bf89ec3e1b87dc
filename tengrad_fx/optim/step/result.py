"""What an optimizer's update computation hands to the shared step (:mod:`.skeleton`)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from torch import Tensor

__all__ = ["StepResult"]


@dataclass
class StepResult:
    """One step's preconditioned updates and what the update computation knows about them.

    Attributes:
        updates: ``{param: u}`` of the preconditioned parameters (``u`` of ``param``'s shape).
        ok: a device ``bool`` scalar of more validity conditions (e.g. every Cholesky
            factor succeeded, or a flag all-reduced over ranks); None: none.
        update_dot: ``Σ u·g`` over ``updates`` as a device scalar when it came for less than
            a pass over ``u`` (TENGraD: from its ``m``-vectors); None: the step computes it.
        grad_sq: a device scalar, finite exactly when the gradients of the keys of
            ``updates`` are (TENGraD: their ``Σ‖g‖²``, read anyway for the KL clip); None:
            the step's finiteness check reads those gradients itself.
    """

    updates: dict[Tensor, Tensor] = field(default_factory=dict)
    ok: Optional[Tensor] = None
    update_dot: Optional[Tensor] = None
    grad_sq: Optional[Tensor] = None
