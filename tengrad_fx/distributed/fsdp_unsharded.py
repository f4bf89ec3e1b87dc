"""The unsharded parameters an FSDP2 forward runs with, the leaves of its autograd graph.

``fully_shard`` keeps each parameter sharded (a DTensor, the module's attribute between
forward and backward, ``reshard_after_forward``) and gathers it into an unsharded
``nn.Parameter`` for the module's forward and backward. That unsharded parameter is one
object for the module's lifetime (FSDP frees and refills its storage), and it is the leaf
the forward's graph holds. A backward taken to a sharded parameter (``torch.autograd.grad``,
as TENGraD's MC and Gauss-Newton backwards are) runs only the nodes that lead to one of its
inputs: none below a sharded layer, so its capture ops would not run. :func:`unsharded_weights`
finds each sharded parameter's unsharded one, once per FSDP module (``reshard``, read its
parameters, ``unshard``, read them again, and back to the state it was in: one module's
parameters gathered at a time; the root, unsharded after its forward, is gathered again into
the same storage), and keeps them for later steps.
"""
from __future__ import annotations

from typing import Any, Sequence, cast

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

__all__ = ["unsharded_weights"]


def unsharded_weights(modules: Sequence[Any], weights: list[Tensor],
                      known: dict[Tensor, Tensor]) -> list[Tensor]:
    """The covered weights ``weights`` (sharded, or unsharded as a module holds them
    now; an added parameter's holder keeps the sharded one) as the parameters the forward ran
    with; ``known``: sharded -> unsharded, filled here on the first call that meets a sharded
    weight not in it, for every FSDP module's own parameters (its state restored after)."""
    if any(isinstance(w, DTensor) and w not in known for w in weights):
        for mod in modules:
            params = cast(torch.nn.Module, mod).named_parameters
            before = dict(params())
            mod.reshard()
            sharded = dict(params())
            mod.unshard()
            found = {n: (sharded[n], p) for n, p in params()
                     if isinstance(sharded[n], DTensor) and not isinstance(p, DTensor)}
            known.update(found.values())
            if all(isinstance(before[n], DTensor) for n in found):  # it was sharded: as it was
                mod.reshard()
    return [known.get(w, w) for w in weights]
