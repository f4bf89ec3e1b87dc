"""MC ("true") Fisher: sampled targets and one backward that records ``G`` only."""
from __future__ import annotations

from typing import Literal, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from ...capture.store import CaptureStore

__all__ = ["mc_capture", "sample_targets", "second_backward"]


def second_backward(loss: Tensor, inputs: Sequence[Tensor]) -> None:
    """``torch.autograd.grad(loss, inputs, retain_graph=True)``, with a clear error where a
    compiled backward refuses to keep its graph (:func:`tengrad_fx._compile.keep_saved_tensors`)."""
    try:
        torch.autograd.grad(loss, inputs, retain_graph=True, allow_unused=True)
    except RuntimeError as exc:
        if "donated buffer" not in str(exc):
            raise
        raise RuntimeError(
            "tengrad_fx: the MC/Gauss-Newton Fisher backpropagates twice through the model, which this "
            "torch.compile-d backward refuses (its saved tensors are donated). tengrad_fx.prepare() turns "
            "donation off; leave torch._functorch.config.donated_buffer False when compiling a prepared model."
        ) from exc


@torch.no_grad()
def sample_targets(outputs: Tensor, mc_loss: Literal["cross_entropy", "mse"],
                   generator: Optional[torch.Generator] = None) -> Tensor:
    """Targets sampled from the model's prediction: ``[m, *]`` class indices from the
    softmax of ``outputs`` (``[m, *, classes]`` logits) for ``cross_entropy``, or
    ``outputs + N(0, 1)`` for ``mse``; ``generator``: None for the global RNG."""
    if mc_loss == "cross_entropy":
        probs = torch.softmax(outputs.detach().float(), dim=-1)
        flat = probs.reshape(-1, probs.shape[-1])
        return torch.multinomial(flat, 1, generator=generator).reshape(probs.shape[:-1])
    noise = torch.randn(outputs.shape, dtype=outputs.dtype, device=outputs.device, generator=generator)
    return outputs.detach() + noise


def mc_capture(store: CaptureStore, outputs: Tensor, mc_loss: Literal["cross_entropy", "mse"],
               weights: Sequence[Tensor], target: Optional[Tensor] = None,
               loss_scale: Optional[Tensor] = None) -> None:
    """Sample targets from ``outputs`` (:func:`sample_targets`; or use ``target``, e.g.
    labels sampled elsewhere), and backpropagate the sampled loss (mean over the batch)
    through the graph with the store in G-only mode: the covered layers record ``G`` (and,
    where chosen, per-sample gradients) but compute no parameter gradients. Afterwards the
    store stops recording, so the real ``loss.backward()`` does not overwrite the MC ``G``.
    ``loss_scale``: a GradScaler's scale, multiplied into the sampled loss so that these
    records carry the same scale as the training backward's (:mod:`.amp`).
    """
    if target is None:
        target = sample_targets(outputs, mc_loss)
    if mc_loss == "cross_entropy":
        loss = F.cross_entropy(outputs.reshape(-1, outputs.shape[-1]), target.reshape(-1))
    else:
        loss = 0.5 * (outputs - target).pow(2).reshape(outputs.shape[0], -1).sum(1).mean()
    if loss_scale is not None:
        loss = loss * loss_scale
    store.grad_only = True
    try:
        second_backward(loss, weights)
    finally:
        store.grad_only = False
    store.recording = False
