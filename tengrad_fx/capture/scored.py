"""The positions a sequence model's loss scores, read from the call of the prepared model.

A padded language-model batch scores only some of its ``[B, L]`` positions: Hugging Face's
collators set ``labels = -100`` at padding, a causal LM's loss shifts by one (position ``t``
predicts token ``t + 1``, so the last position is never scored), and ``attention_mask`` is 0
at padding. The curvature that is drawn from the positions — the MC Fisher's sampled labels
(:mod:`tengrad_fx.optim.step.mc`) and ``TENGraD(position_rows=k)`` — must leave out what the
loss leaves out. :func:`scored_positions` reads it from the keyword inputs of a capturing
forward, in this order:

1. a Hugging Face model called with ``labels=`` (``[B, L]``), or with ``shift_labels=``: the
   positions its loss scores. Causal LMs (``loss_type`` ``"ForCausalLM"``, or none, which
   Hugging Face reads as causal) score position ``t`` where ``labels[:, t + 1] != -100``
   (``shift_labels != -100`` where given); masked-LM and token-classification heads
   (``"ForMaskedLM"``, ``"ForTokenClassification"``) score ``labels != -100``;
2. else an ``attention_mask`` (``[B, L]``): its non-zero positions. It cannot know what a
   loss computed outside the model leaves out (the last position of a shifted loss in a
   plain loop): pass ``mask=`` to ``mc_capture`` there;
3. else nothing (None): every position counts.

The result is a bool ``[B, L]`` on the device of its source (no host read), kept in the
model's :class:`~.store.CaptureStore` (``scored``) by :func:`note_scored`; it is used only
where its shape is that of the positions it describes (``logits.shape[:-1]``, or a layer's
``m·S`` rows), so a sequence-classification head (logits ``[B, C]``) keeps its behaviour.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Optional

import torch
from torch import Tensor

from .store import lookup

__all__ = ["IGNORE_INDEX", "fits", "note_scored", "scored_positions"]

IGNORE_INDEX = -100  # Hugging Face's (and F.cross_entropy's) label of an unscored position
_CAUSAL = (None, "ForCausalLM")  # loss types whose labels are shifted by one (None: HF's default)
_ALIGNED = ("ForMaskedLM", "ForTokenClassification")  # loss types that score labels where they stand
_SOURCES = {"labels", "shift_labels", "attention_mask"}  # the keywords a mask is read from


def _labels_scored(model: Any, kwargs: Mapping[str, Any]) -> Optional[Tensor]:
    """Rule 1 of the module docstring: the positions a Hugging Face model's own loss scores."""
    if not hasattr(model, "loss_function"):
        return None
    shifted = kwargs.get("shift_labels")
    if isinstance(shifted, Tensor) and shifted.dim() >= 2:
        return shifted != IGNORE_INDEX
    labels = kwargs.get("labels")
    if not isinstance(labels, Tensor) or labels.dim() < 2 or labels.is_floating_point():
        return None
    loss_type = getattr(model, "loss_type", None)
    if loss_type in _ALIGNED:
        return labels != IGNORE_INDEX
    if loss_type in _CAUSAL:
        scored = torch.zeros_like(labels, dtype=torch.bool)
        scored[..., :-1] = labels[..., 1:] != IGNORE_INDEX
        return scored
    return None


def scored_positions(model: Any, kwargs: Mapping[str, Any]) -> Optional[Tensor]:
    """The positions the loss of this call scores (bool ``[B, L]``), or None for all
    (module docstring). ``model``: the prepared model; ``kwargs``: its call's keywords."""
    scored = _labels_scored(model, kwargs)
    if scored is not None:
        return scored
    attention = kwargs.get("attention_mask")
    if isinstance(attention, Tensor) and attention.dim() == 2:
        return attention != 0
    return None


def note_scored(key: int, model: Any, kwargs: Mapping[str, Any], out: Any) -> None:
    """Keep this capturing forward's scored positions in the store of capture ``key`` where
    they fit its output ``out`` (a tensor or a mapping's ``"logits"``, ``[B, L, c]``), else
    None (called after the forward, once its micro-batch has begun). Under ``torch.compile``
    nothing is kept (the micro-batch's store starts with None): pass ``mask=`` there."""
    if torch.compiler.is_compiling() or not _SOURCES.intersection(kwargs):
        return
    scored = scored_positions(model, kwargs)
    logits = out if isinstance(out, Tensor) else out.get("logits") if isinstance(out, Mapping) else None
    fit = isinstance(logits, Tensor) and fits(scored, logits.shape[:-1])
    lookup(key).scored = scored if fit else None


def fits(scored: Optional[Tensor], lead: torch.Size | tuple[int, ...]) -> bool:
    """Does ``scored`` describe positions of shape ``lead`` (e.g. ``logits.shape[:-1]``)?"""
    return scored is not None and len(lead) >= 2 and tuple(scored.shape) == tuple(lead)
