"""The unsharded parameters an FSDP2 forward runs with, the leaves of its autograd graph.

``fully_shard`` keeps each parameter sharded (a DTensor, the module's attribute between
forward and backward, ``reshard_after_forward``) and gathers it into an unsharded
``nn.Parameter`` for the module's forward and backward. That unsharded parameter is one
object for the module's lifetime (FSDP frees and refills its storage), and it is the leaf
the forward's graph holds. A backward taken to a sharded parameter (``torch.autograd.grad``,
as TENGraD's MC and Gauss-Newton backwards are) runs only the nodes that lead to one of its
inputs: none below a sharded layer, so its capture ops would not run. :func:`unsharded_weights`
finds each sharded weight's unsharded parameter, once per FSDP module (``unshard``, read the
covered modules' attributes, ``reshard``: one module's parameters gathered at a time; a
module already unsharded, the root after its forward, is left as it is), and keeps them for
later steps.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from .fsdp import fsdp_modules

__all__ = ["unsharded_weights"]


def unsharded_weights(model: torch.nn.Module, read: Callable[[], list[Tensor]],
                      known: dict[Tensor, Tensor]) -> list[Tensor]:
    """The covered weights ``read()`` returns (as the modules hold them now: sharded, or
    unsharded) as the parameters the forward ran with; ``known``: sharded -> unsharded,
    filled here on the first call that meets a sharded weight not in it."""
    weights = read()
    if any(isinstance(w, DTensor) and w not in known for w in weights):
        for mod in fsdp_modules(model):
            before = read()
            mod.unshard()
            found: dict[Tensor, Tensor] = {s: u for s, u in zip(before, read())
                                           if isinstance(s, DTensor) and not isinstance(u, DTensor)}
            if found:  # else it was unsharded already (the root after its forward): left as it was
                mod.reshard()
            known.update(found)
    return [known.get(w, w) for w in weights]
