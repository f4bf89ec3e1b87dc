"""MC ("true") Fisher: sampled targets and one backward that records ``G`` only."""
from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from ..capture.store import CaptureStore

__all__ = ["mc_capture"]


def mc_capture(store: CaptureStore, outputs: Tensor, mc_loss: Literal["cross_entropy", "mse"],
               weights: list[Tensor]) -> None:
    """Sample targets from ``outputs`` (``[m, *, classes]`` logits: categorical; ``mse``:
    ``outputs + N(0, 1)``), and backpropagate the sampled loss (mean over the batch) through
    the graph with the store in G-only mode: the covered layers record ``G`` (and, where
    chosen, per-sample gradients) but compute no parameter gradients. Afterwards the
    store stops recording, so the real ``loss.backward()`` does not overwrite the MC ``G``.
    """
    with torch.no_grad():
        if mc_loss == "cross_entropy":
            probs = torch.softmax(outputs.detach().float(), dim=-1)
            target = torch.multinomial(probs.reshape(-1, probs.shape[-1]), 1).reshape(probs.shape[:-1])
        else:
            target = outputs.detach() + torch.randn_like(outputs)
    if mc_loss == "cross_entropy":
        loss = F.cross_entropy(outputs.reshape(-1, outputs.shape[-1]), target.reshape(-1))
    else:
        loss = 0.5 * (outputs - target).pow(2).reshape(outputs.shape[0], -1).sum(1).mean()
    store.grad_only = True
    try:
        torch.autograd.grad(loss, weights, retain_graph=True, allow_unused=True)
    finally:
        store.grad_only = False
    store.recording = False
