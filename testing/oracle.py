"""Independent references: per-sample gradients by ``torch.func.vmap(grad(...))``."""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.nn as nn
import torch.utils._pytree as pytree
from torch import Tensor
from torch.func import functional_call, grad, vmap


def per_sample_grads_reference(
    model: nn.Module, x: Any, loss_fn: Callable[[Tensor, Tensor], Tensor], y: Tensor,
) -> dict[str, Tensor]:
    """``{param name: [m, *param.shape]}`` of ``loss_fn(model(x_i[None]), y_i[None])``.

    ``model`` must be the ORIGINAL (unprepared) module, in eval mode if it has batch norm.
    ``x`` is a tensor or a pytree of them (dicts, tuples, lists, registered dataclasses):
    the tensor leaves whose leading dim is ``m = len(y)`` are split into samples, the
    other leaves are passed whole to every sample's call.
    """
    params = {k: v.detach() for k, v in model.named_parameters()}
    buffers = {k: v.detach() for k, v in model.named_buffers()}
    leaves, spec = pytree.tree_flatten(x)
    m = y.shape[0]
    idx = [i for i, t in enumerate(leaves) if isinstance(t, Tensor) and t.dim() > 0 and t.shape[0] == m]

    def loss_i(p: dict[str, Tensor], batched: list[Tensor], yi: Tensor) -> Tensor:
        parts = list(leaves)
        for i, t in zip(idx, batched):
            parts[i] = t.unsqueeze(0)
        out = functional_call(model, (p, buffers), (pytree.tree_unflatten(parts, spec),))
        return loss_fn(out, yi.unsqueeze(0))

    return vmap(grad(loss_i), in_dims=(None, 0, 0))(params, [leaves[i] for i in idx], y)


def explicit_jacobian(psg: dict[str, Tensor], weight_name: str, bias_name: Optional[str]) -> Tensor:
    """``J`` (``[m, n]``) with rows ``vec(dW_i, db_i)`` from reference per-sample grads."""
    parts = [psg[weight_name].flatten(1)]
    if bias_name is not None:
        parts.append(psg[bias_name].flatten(1))
    return torch.cat(parts, 1)
