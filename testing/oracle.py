"""Independent references: per-sample gradients by ``torch.func.vmap(grad(...))``."""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn as nn
from torch import Tensor
from torch.func import functional_call, grad, vmap


def per_sample_grads_reference(
    model: nn.Module, x: Tensor, loss_fn: Callable[[Tensor, Tensor], Tensor], y: Tensor,
) -> dict[str, Tensor]:
    """``{param name: [m, *param.shape]}`` of ``loss_fn(model(x_i[None]), y_i[None])``.

    ``model`` must be the ORIGINAL (unprepared) module, in eval mode if it has batch norm.
    """
    params = {k: v.detach() for k, v in model.named_parameters()}
    buffers = {k: v.detach() for k, v in model.named_buffers()}

    def loss_i(p: dict[str, Tensor], xi: Tensor, yi: Tensor) -> Tensor:
        out = functional_call(model, (p, buffers), (xi.unsqueeze(0),))
        return loss_fn(out, yi.unsqueeze(0))

    return vmap(grad(loss_i), in_dims=(None, 0, 0))(params, x, y)


def explicit_jacobian(psg: dict[str, Tensor], weight_name: str, bias_name: Optional[str]) -> Tensor:
    """``J`` (``[m, n]``) with rows ``vec(dW_i, db_i)`` from reference per-sample grads."""
    parts = [psg[weight_name].flatten(1)]
    if bias_name is not None:
        parts.append(psg[bias_name].flatten(1))
    return torch.cat(parts, 1)
