"""Several optimizers stepping together as one ``torch.optim.Optimizer`` (``tools.peer_methods``'
``muon-torch``: ``torch.optim.Muon`` on the hidden matrices, ``torch.optim.AdamW`` on the rest).

:class:`Chained`'s ``param_groups`` are the inner optimizers' own group dictionaries (the same
objects, in order), so an lr scheduler built on it (``LambdaLR``) sets every inner lr;
``step`` and ``zero_grad`` call each inner one; ``state_dict`` holds theirs.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch

__all__ = ["Chained"]


class Chained(torch.optim.Optimizer):
    """The optimizers ``inner`` (over disjoint parameters) as one optimizer."""

    def __init__(self, *inner: torch.optim.Optimizer) -> None:
        if not inner:
            raise ValueError("Chained: give at least one optimizer")
        self.inner = list(inner)
        # Optimizer.__init__ appends each group dictionary itself: the inner groups are shared, and a
        # parameter in two of them is refused there.
        super().__init__([g for opt in self.inner for g in opt.param_groups], defaults={})

    def step(self, closure: Optional[Callable[[], float]] = None) -> Optional[float]:  # type: ignore[override]
        """One step of every inner optimizer (``closure``, if given, evaluated once, first)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for opt in self.inner:
            opt.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.inner:
            opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return {"inner": [opt.state_dict() for opt in self.inner]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for opt, sd in zip(self.inner, state_dict["inner"], strict=True):
            opt.load_state_dict(sd)
